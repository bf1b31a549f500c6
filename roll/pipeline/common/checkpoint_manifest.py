"""``manifest.json`` of a step checkpoint: the relative path, size and sha256 of every file in it.

A save writes the manifest last, after every file is on disk; a load verifies it first, so a
flipped byte, a truncated or missing file, or a checkpoint whose save never finished is one
``CheckpointError: <checkpoint dir>/<file>: <what>`` line before any state is read.

>>> write_manifest(Path("ckpt/.tmp-step_4"))
>>> verify_checkpoint(Path("ckpt/step_4"), roles=["actor_train"])   # raises CheckpointError
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from roll.core.errors import CheckpointError
from roll.utils.atomic_io import write_file_durably
from roll.utils.safe_unpickle import UnsafePickleError, check_dcp_dir

MANIFEST = "manifest.json"
STATE_FILE = "pipeline_state.json"
FORMAT = 1
_CHUNK = 8 << 20
# torch.distributed.checkpoint's pickled metadata (also inside megatron dist checkpoints).
_PICKLED_METADATA = ".metadata"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _hash_all(root: Path, rels: list[str]) -> list[str]:
    """sha256 of each file, several at once (hashlib releases the GIL on large reads)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda rel: file_sha256(root / rel), rels))


def write_manifest(root: Path) -> dict[str, Any]:
    """Hash every file under ``root`` and write ``root/manifest.json`` durably (call it last)."""
    rels = _files(root)
    digests = _hash_all(root, rels)
    files = {rel: {"size": (root / rel).stat().st_size, "sha256": d} for rel, d in zip(rels, digests)}
    manifest = {"format": FORMAT, "files": files}
    write_file_durably(root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def read_manifest(root: Path) -> dict[str, dict[str, Any]]:
    """The ``files`` table of ``root/manifest.json``; CheckpointError when missing or malformed."""
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing (a save writes it last: the save did not finish, or the checkpoint "
            "was written by a roll without manifests)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a roll checkpoint manifest (format {FORMAT} expected)")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(_valid_entry(rel, e) for rel, e in files.items()):
        raise CheckpointError(f"{path}: malformed 'files' table")
    return files


def _valid_entry(rel: Any, entry: Any) -> bool:
    if not isinstance(rel, str) or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
        return False
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and isinstance(entry.get("sha256"), str)
    )


def verify_checkpoint(root: Path, roles: Iterable[str] = ()) -> None:
    """Raise ``CheckpointError`` naming the first file that does not match the manifest, a missing
    ``pipeline_state.json`` or role directory, or pickled metadata that could run code."""
    files = read_manifest(root)
    for required in (STATE_FILE, *roles):
        if not any(rel == required or rel.startswith(f"{required}/") for rel in files):
            raise CheckpointError(f"{root / required}: missing from the checkpoint")
    for rel, entry in files.items():
        path = root / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{path}: {size} bytes, {MANIFEST} says {entry['size']} (truncated or changed)"
            )
    rels = sorted(files)
    for rel, digest in zip(rels, _hash_all(root, rels)):
        if digest != files[rel]["sha256"]:
            raise CheckpointError(f"{root / rel}: sha256 differs from {MANIFEST} (the file is corrupted)")
    for rel in rels:
        if PurePosixPath(rel).name == _PICKLED_METADATA:
            dcp_dir = (root / rel).parent
            try:
                check_dcp_dir(dcp_dir, _PICKLED_METADATA)
            except UnsafePickleError as exc:
                raise CheckpointError(f"{dcp_dir}/{exc}") from None
    read_state(root)


def read_state(root: Path) -> dict[str, Any]:
    """``pipeline_state.json`` (step, sampler position, RNG); CheckpointError when unreadable."""
    path = root / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    missing = [k for k in ("step", "sampler", "rng") if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: no {', '.join(missing)} (not a roll pipeline state)")
    return state
