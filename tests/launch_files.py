"""Files a config must point at to pass the checks before launch (roll.launch.files): a model
directory with a config.json and a tokenizer file, and prompt files whose rows carry given tags.
Nothing here loads; the files only have to exist and parse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def make_launch_files(tmp: Path, tags: tuple[str, ...] = ("arithmetic",)) -> dict[str, Path]:
    """``{"model": dir, "train": jsonl, "val": jsonl}`` under ``tmp``; one row per tag per file."""
    model = tmp / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    files = {"model": model}
    for split in ("train", "val"):
        rows = [{"prompt": f"1 + {i} = ?", "ground_truth": str(1 + i), "tag": t} for i, t in enumerate(tags)]
        files[split] = tmp / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


def launch_overrides(files: dict[str, Path], validation: bool = True) -> list[str]:
    """``key=value`` overrides pointing the default example's keys at ``files``."""
    out = [f"pretrain={files['model']}", f"actor_train.data_args.file_name=[{files['train']}]"]
    if validation:
        out.append(f"validation.data_args.file_name=[{files['val']}]")
    return out


def point_at_files(raw: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """A shipped config's plain data with its model and prompt paths replaced by files made in
    ``tmp`` (rows tagged with every tag its reward roles route)."""
    tags = tuple(t for r in (raw.get("rewards") or {}).values() for t in r.get("tag_included") or []) or (
        "t",
    )
    files = make_launch_files(tmp, tags)
    raw = yaml.safe_load(yaml.safe_dump(raw))
    raw["pretrain"] = str(files["model"])
    raw["actor_train"].setdefault("data_args", {})["file_name"] = [str(files["train"])]
    if raw.get("validation"):
        raw["validation"].setdefault("data_args", {})["file_name"] = [str(files["val"])]
    return raw
