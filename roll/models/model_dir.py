"""Where a role's model lives: a local Hugging Face model directory (it holds a config.json).

>>> check_model_dir("models/qwen2.5-0.5b", "actor_train.model_args.model_name_or_path")

Used by the loader of every strategy and by the pre-launch check (roll.launch.files), so both
report a missing or wrong directory the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from roll.configs.errors import ConfigError


def check_model_dir(path: str | None, key: str = "model_args.model_name_or_path") -> str:
    """``path`` is a Hugging Face model directory (it holds a config.json); returns it."""
    if not path:
        raise ConfigError(key, "is not set; point it at a Hugging Face model directory")
    if not Path(path).is_dir():
        hint = f"relative paths start at {Path.cwd()}"
        if _looks_like_hub_name(path):
            hint = (
                "roll loads local directories; download it first, e.g. huggingface-cli download "
                f"{path} --local-dir models/{path.split('/')[-1]}, and point {key} there"
            )
        raise ConfigError(key, f"model directory {path!r} does not exist ({hint})")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(key, f"{path!r} is not a Hugging Face model directory (no config.json there)")
    return path


def config_json(path: str | None) -> dict[str, Any]:
    """The directory's config.json as a dict: {} where there is none or it is not JSON (the model's
    load names those problems; callers here only look for keys)."""
    file = Path(path or "") / "config.json"
    try:
        return json.loads(file.read_text() or "{}") if path and file.is_file() else {}
    except ValueError:
        return {}


def _looks_like_hub_name(path: str) -> bool:
    """``org/name`` as on the Hugging Face hub (not ``./x``, ``/x`` or ``a/b/c``)."""
    return not path.startswith((".", "/", "~")) and path.count("/") == 1
