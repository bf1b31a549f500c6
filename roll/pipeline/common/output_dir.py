"""One run owns its ``output_dir``: a lock file while it runs, and no silent overwrite of a
finished or interrupted run.

>>> lock = claim_output_dir(config)   # ConfigError: output_dir: ... is in use by pid 4242 on node-3
>>> ...                               # the run
>>> lock.release()

The lock is ``<output_dir>/.roll.lock``, held with ``flock`` for the life of the driver (the kernel
drops it when the process dies, however it dies) and holding ``{"pid", "host", "started"}``. A lock
file left by a dead process is taken over with a warning. A fresh run (no
``resume_from_checkpoint``) into a directory that already holds ``metrics.jsonl``, ``hf_model/`` or
step checkpoints refuses, unless ``overwrite_output_dir: true``, which deletes them first.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.run_config import RunConfig, resume_requested
from roll.core.errors import StorageError
from roll.pipeline.common.checkpoint import checkpoint_root, step_dirs
from roll.utils.atomic_io import disk_full_as

logger = logging.getLogger("roll")

LOCK_FILE = ".roll.lock"
RUN_FILES = ("metrics.jsonl", "hf_model", "curves.png")


class OutputDirLock:
    """An exclusive lock on ``run_dir`` (see the module docstring); ``release`` removes it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; ConfigError when another run holds it, StorageError naming the lock
        file when it cannot be written (a full disk), leaving no empty lock file behind."""
        with disk_full_as(StorageError, self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError("output_dir", f"{self.path.parent} is in use by {_describe(holder)}") from None
        holder = _read_holder(fd)
        if holder and _alive_elsewhere(holder):  # a filesystem where flock does not reach
            os.close(fd)
            raise ConfigError("output_dir", f"{self.path.parent} is in use by {_describe(holder)}")
        if holder:
            logger.warning("output_dir: taking over the stale lock of %s", _describe(holder))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            with disk_full_as(StorageError, self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(me).encode(), 0)
                os.fsync(fd)
        except BaseException:
            self.path.unlink(missing_ok=True)  # ours while we hold the flock; emptied above
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another run (its lock file holds no owner)"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')} (lock file {LOCK_FILE})"


def _alive_elsewhere(holder: dict[str, Any]) -> bool:
    """The lock names a live process of this host other than this one."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def existing_run_files(config: RunConfig) -> list[Path]:
    """What a previous run left in ``output_dir`` (and the checkpoint dir) that a fresh run would replace."""
    run_dir = Path(config.output_dir)
    found = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    root = checkpoint_root(config)
    if root.is_dir():  # with the copies a save stopped between its renames left aside
        found += [path for _, path in step_dirs(root)] + sorted(root.glob(".old-step_*"))
    return found


def claim_output_dir(config: RunConfig) -> OutputDirLock:
    """Lock ``output_dir``; refuse a fresh run over an existing one unless ``overwrite_output_dir``
    (which then deletes the old run's metrics, model and checkpoints)."""
    lock = OutputDirLock(Path(config.output_dir))
    lock.acquire()
    found = [] if resume_requested(config.resume_from_checkpoint) else existing_run_files(config)
    if found and not config.overwrite_output_dir:
        lock.release()
        shown = ", ".join(str(p) for p in found[:3]) + (
            f" and {len(found) - 3} more" if len(found) > 3 else ""
        )
        raise ConfigError(
            "output_dir",
            f"{config.output_dir} already holds a run ({shown}); resume it with "
            "resume_from_checkpoint=true, replace it with overwrite_output_dir=true, or pick another output_dir",
        )
    for path in found:
        logger.warning("overwrite_output_dir: deleting %s of the previous run", path)
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return lock
