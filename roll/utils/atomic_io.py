"""Durable file writes: fsync'd files and directories, atomic replacement, and disk-full errors
reported as one line naming the file.

>>> write_file_durably(Path("out/state.json"), json.dumps(state))   # tmp file, fsync, rename
>>> with write_dir_durably(Path("out/hf_model")) as tmp:          # out/.tmp-hf_model, then renamed
...     model.save_pretrained(tmp)
>>> with disk_full_as(StorageError, Path("out/metrics.jsonl")):
...     append_line_durably(Path("out/metrics.jsonl"), line)
StorageError: out/metrics.jsonl: No space left on device (out/metrics.jsonl)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

DISK_FULL = "No space left on device"
_DISK_FULL_FILE = re.compile(r"(?:No space left on device|Disk quota exceeded): '([^']+)'")


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk. Filesystems that cannot fsync a
    directory (EINVAL / ENOTSUP, e.g. some FUSE mounts) are let off for directories."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if not (exc.errno in (errno.EINVAL, errno.ENOTSUP) and os.path.isdir(path)):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself), deepest first."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def write_file_durably(path: Path, text: str | bytes) -> None:
    """Write ``text`` (str, or bytes written as they are) to ``path`` through a temporary file:
    fsync, rename, fsync the directory. A reader sees the old content or the new one, never a part."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        with tmp.open("wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def append_line_durably(path: Path, line: str) -> None:
    """Append one whole line (flush + fsync); on failure cut the file back to its old length, so
    a full disk leaves no torn line behind."""
    if not line.endswith("\n") or "\n" in line[:-1]:
        raise ValueError("append_line_durably takes exactly one line ending in a newline")
    with path.open("a") as f:
        size = f.tell()
        try:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.truncate(path, size)
            raise


def replace_dir(tmp: Path, final: Path) -> None:
    """Put directory ``tmp`` in place of ``final``; an existing ``final`` is renamed aside first
    and deleted only once the new one is in place, so a crash at any point leaves one of them
    whole (``final``, or ``final``'s ``.old-`` copy next to it)."""
    old = final.with_name(f".old-{final.name}")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old)


@contextlib.contextmanager
def write_dir_durably(final: Path) -> Iterator[Path]:
    """Yield an empty ``.tmp-<name>`` directory next to ``final`` to write into; when the block
    ends, fsync everything in it and put it in place of ``final`` (``replace_dir``). If the block
    fails, or the process dies in it, ``final`` keeps its previous content and nothing half-written
    carries its name (a leftover ``.tmp-`` directory is removed by the next write)."""
    final = Path(final)
    tmp = final.with_name(f".tmp-{final.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, final)


def is_disk_full(exc: BaseException) -> bool:
    """An ENOSPC / EDQUOT OSError, or an error whose message says the disk is full (as a worker's
    error does once it has crossed Ray)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return DISK_FULL in str(exc) or "Disk quota exceeded" in str(exc)


def disk_full_message(exc: BaseException, where: Path) -> str:
    """``<where>: No space left on device (<the file being written>)``."""
    filename = getattr(exc, "filename", None)
    if not filename:  # a worker's OSError that crossed Ray keeps only its text
        match = _DISK_FULL_FILE.search(str(exc))
        filename = match.group(1) if match else where
    return f"{where}: {DISK_FULL} ({filename})"


@contextlib.contextmanager
def disk_full_as(error_type: type[Exception], where: Path) -> Iterator[None]:
    """Turn a disk-full OSError raised in the block into ``error_type`` with one line naming
    ``where`` and the file that could not be written; other errors pass unchanged."""
    try:
        yield
    except OSError as exc:
        if is_disk_full(exc):
            raise error_type(disk_full_message(exc, where)) from exc
        raise
