"""Check that a pickle builds only plain checkpoint metadata before torch unpickles it.

torch.distributed.checkpoint (which megatron's dist checkpoints use too) stores its ``.metadata``
file as a pickle and loads it with ``pickle.load``: a crafted file runs any code on resume. This
reads the same bytes with an unpickler that can only build dataclasses and enums of
``torch.distributed.checkpoint`` and what torch's own ``weights_only`` loader allows (``torch.Size``,
dtypes, layouts, ``OrderedDict``, ...).

>>> check_metadata_pickle(Path("ckpt/step_4/actor_train/.metadata"))   # raises UnsafePickleError
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


def check_metadata_pickle(path: Path) -> None:
    """Raise ``UnsafePickleError`` unless ``path`` unpickles to plain checkpoint metadata."""
    try:
        _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to read it back is a bad file
        raise UnsafePickleError(f"not a readable pickle ({type(exc).__name__}: {exc})") from exc
