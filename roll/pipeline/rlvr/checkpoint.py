"""Atomic step checkpoints: written to a temporary directory, then renamed into place.

Layout (on a filesystem every node can reach)::

    <checkpoint dir>/step_12/
        pipeline_state.json    step, data position, driver RNG states
        actor_train/           written by the actor_train workers (weights, optimizer, scheduler, RNG)
        critic/                likewise, when there is a critic

A run killed while saving leaves only ``.tmp-step_N``, which the next save removes; ``latest`` never
returns a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(config: RLVRConfig) -> Path:
    return Path(config.checkpoint_config.output_dir or Path(config.output_dir) / "checkpoints")


def save_checkpoint(
    root: Path,
    step: int,
    state: dict[str, Any],
    save_roles: Callable[[Path], None],
    max_to_keep: int | None = None,
) -> Path:
    """``save_roles(tmp_dir)`` makes every role write into ``tmp_dir/<role>``; then the rename."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step_{step}"
    tmp.mkdir()
    save_roles(tmp)
    (tmp / "pipeline_state.json").write_text(json.dumps(state, indent=1))
    final = root / f"step_{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root, max_to_keep)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    steps = [
        (int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    ]
    steps = [(s, p) for s, p in steps if (p / "pipeline_state.json").exists()]
    return max(steps)[1] if steps else None


def resolve_resume(config: RLVRConfig) -> Path | None:
    """Where to resume from: ``true`` = the latest under the checkpoint dir, a path = that one."""
    value = config.resume_from_checkpoint
    if value is False or value in ("", "false", "False", None):
        return None
    if value is True or value in ("true", "True", "latest"):
        found = latest_checkpoint(checkpoint_root(config))
        if found is None:
            raise ConfigError(
                "resume_from_checkpoint", f"no checkpoint found under {checkpoint_root(config)}"
            )
        return found
    path = Path(str(value))
    if not (path / "pipeline_state.json").exists():
        raise ConfigError(
            "resume_from_checkpoint", f"{path} is not a step checkpoint (no pipeline_state.json)"
        )
    return path


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "pipeline_state.json").read_text())


def _prune(root: Path, max_to_keep: int | None) -> None:
    if not max_to_keep:
        return
    steps = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)))
    for _, path in steps[:-max_to_keep]:
        shutil.rmtree(path, ignore_errors=True)
