"""Check that a torch.distributed.checkpoint directory unpickles to data only, before torch loads it.

torch.distributed.checkpoint (which megatron's dist checkpoints use too) unpickles two things
without restriction: its ``.metadata`` index (``pickle.load``) and every non-tensor entry of the
state (``torch.load(weights_only=False)`` in ``DefaultLoadPlanner.load_bytes``); a crafted file
runs any code on resume. ``check_dcp_dir`` reads the index with an unpickler that can only build
dataclasses and enums of ``torch.distributed.checkpoint`` and what torch's own ``weights_only``
loader allows (``torch.Size``, dtypes, ``OrderedDict``, ...), then reads every non-tensor entry
with ``torch.load(weights_only=True)``. (Tensor entries torch already loads with ``weights_only``.)

>>> check_dcp_dir(Path("ckpt/step_4/actor_train"))   # raises UnsafePickleError
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path
from typing import Any

_SAFE_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_SAFE_BUILTINS = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("pathlib", "PosixPath"),  # the checkpoint id DCP records
    ("pathlib", "PurePosixPath"),
}


def _torch_weights_only_globals() -> set[str]:
    """What ``torch.load(weights_only=True)`` may build (its allowlist, e.g. ``torch.Size``)."""
    from torch import _weights_only_unpickler

    return set(_weights_only_unpickler._get_allowed_globals())


class UnsafePickleError(ValueError):
    """The pickle refers to something other than checkpoint metadata (named in the message)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if f"{module}.{name}" in _torch_weights_only_globals():
            return super().find_class(module, name)
        if module.startswith(_SAFE_MODULE_PREFIXES):
            value = super().find_class(module, name)
            if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                return value
        raise UnsafePickleError(f"refers to {module}.{name}, which checkpoint metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("holds a persistent reference, which checkpoint metadata never holds")


def check_metadata_pickle(path: Path) -> Any:
    """The unpickled ``path``; ``UnsafePickleError`` unless it holds plain checkpoint metadata."""
    try:
        return _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to read it back is a bad file
        raise UnsafePickleError(f"not a readable pickle ({type(exc).__name__}: {exc})") from exc


def check_dcp_dir(root: Path, metadata_name: str = ".metadata") -> None:
    """``UnsafePickleError("<file relative to root>: <what>")`` unless ``root``'s index and every
    non-tensor entry (what torch would unpickle without restriction) hold data only."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        metadata = check_metadata_pickle(root / metadata_name)
    except UnsafePickleError as exc:
        raise UnsafePickleError(f"{metadata_name}: {exc}") from None
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise UnsafePickleError(f"{metadata_name}: not a torch.distributed.checkpoint index")
    for index, info in storage.items():
        if not isinstance(entries.get(index.fqn), BytesStorageMetadata):
            continue
        with (root / info.relative_path).open("rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            if info.transform_descriptors:
                raise ValueError(f"transformed entry {list(info.transform_descriptors)}")
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - weights_only refuses code; anything else is bad too
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsafePickleError(
                f"{info.relative_path}: entry {index.fqn!r} is not plain data ({first})"
            ) from None
