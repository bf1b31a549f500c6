"""Atomic, verified step checkpoints: written to a temporary directory, fsync'd, then renamed in.

Layout (on a filesystem every node can reach)::

    <checkpoint dir>/step_12/
        pipeline_state.json    step, data position, driver RNG states
        actor_train/           written by the actor_train workers (weights, optimizer, scheduler, RNG)
        critic/                likewise, when there is a critic
        manifest.json          size and sha256 of every file above; written last

A run killed while saving leaves only ``.tmp-step_N``, which the next save removes; an existing
``step_N`` is renamed aside, not deleted, until the new one is in place. Resuming verifies the
manifest first (see ``checkpoint_manifest``): ``latest`` takes the newest checkpoint that verifies
and warns about each newer one it skips; a checkpoint named by path must verify.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.run_config import RunConfig, resume_requested
from roll.core.errors import CheckpointError
from roll.core.roles import TRAINER_ROLES
from roll.pipeline.common.checkpoint_manifest import MANIFEST, read_state, verify_checkpoint, write_manifest
from roll.utils.atomic_io import disk_full_message, is_disk_full, write_dir_durably, write_file_durably

__all__ = [
    "checkpoint_root",
    "latest_checkpoint",
    "newest_checkpoint",
    "read_state",
    "resolve_resume",
    "save_checkpoint",
]

logger = logging.getLogger("roll")

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(config: RunConfig) -> Path:
    return Path(config.checkpoint_config.output_dir or Path(config.output_dir) / "checkpoints")


def checkpoint_roles(config: RunConfig) -> list[str]:
    """The roles whose state a step checkpoint holds: the trainer roles the config has."""
    return [name for name in TRAINER_ROLES if getattr(config, name, None) is not None]


def save_checkpoint(
    root: Path,
    step: int,
    state: dict[str, Any],
    save_roles: Callable[[Path], None],
    max_to_keep: int | None = None,
) -> Path:
    """``save_roles(tmp_dir)`` makes every role write into ``tmp_dir/<role>``; then the driver's
    state, the manifest (last), fsync of everything and the rename (``write_dir_durably``). A failure removes the
    temporary directory; a full disk is one ``CheckpointError`` line naming the file."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step}"
    try:
        with write_dir_durably(final) as tmp:  # fsynced, then renamed to final; removed on failure
            save_roles(tmp)
            write_file_durably(tmp / "pipeline_state.json", json.dumps(state, indent=1, allow_nan=False))
            write_manifest(tmp)
    except BaseException as exc:
        if is_disk_full(exc):
            raise CheckpointError(disk_full_message(exc, root / f".tmp-step_{step}")) from exc
        raise
    _prune(root, max_to_keep)
    return final


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_N`` directory under ``root``, newest first."""
    found = [
        (int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    ]
    return sorted(found, reverse=True)


def newest_checkpoint(root: Path) -> Path | None:
    """The newest ``step_N`` under ``root`` that has its manifest (a complete save), without
    hashing its files (``latest_checkpoint`` verifies them): what a stopped run names as its last."""
    return next((path for _, path in step_dirs(root) if (path / MANIFEST).is_file()), None)


def latest_checkpoint(root: Path, roles: Iterable[str] = ("actor_train",)) -> Path | None:
    """The newest checkpoint under ``root`` that verifies; each newer one that does not is named
    in a warning with the reason. None when there is no step directory at all; CheckpointError
    when there are some and none verifies."""
    _recover_renamed_aside(root)
    skipped = []
    for _, path in step_dirs(root):
        try:
            verify_checkpoint(path, roles)
        except CheckpointError as exc:
            logger.warning("resume: skipping invalid checkpoint %s: CheckpointError: %s", path, exc)
            skipped.append(str(exc))
            continue
        if skipped:
            logger.warning(
                "resume: %d newer checkpoint(s) were invalid; resuming from %s", len(skipped), path
            )
        return path
    if skipped:
        raise CheckpointError(f"{root}: no valid checkpoint ({len(skipped)} invalid; newest: {skipped[0]})")
    return None


def resolve_resume(config: RunConfig) -> Path | None:
    """Where to resume from: ``true`` = the newest valid one under the checkpoint dir, a path =
    that one, which must verify. Either way the result has been verified against its manifest."""
    if not resume_requested(config.resume_from_checkpoint):
        return None
    value = config.resume_from_checkpoint
    roles = checkpoint_roles(config)
    if value is True or value in ("true", "True", "latest"):
        found = latest_checkpoint(checkpoint_root(config), roles)
        if found is None:
            raise ConfigError(
                "resume_from_checkpoint", f"no checkpoint found under {checkpoint_root(config)}"
            )
        return found
    path = Path(str(value))
    if not path.is_dir():
        raise ConfigError("resume_from_checkpoint", f"{path}: no such checkpoint directory")
    verify_checkpoint(path, roles)
    return path


def _recover_renamed_aside(root: Path) -> None:
    """A save killed between its two renames leaves ``.old-step_N`` and no ``step_N``: put it back."""
    for old in root.glob(".old-step_*"):
        final = root / old.name.removeprefix(".old-")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            logger.warning("checkpoint: restoring %s (a save stopped while replacing it)", final)
            os.replace(old, final)


def _prune(root: Path, max_to_keep: int | None) -> None:
    if not max_to_keep:
        return
    for _, path in step_dirs(root)[max_to_keep:]:
        shutil.rmtree(path, ignore_errors=True)
