"""``ConfigError``: a configuration problem reported as one line naming the key path, and the helpers
that build such lines. Errors of a running job (a file, a checkpoint, a reward role) are in
``roll.core.errors``."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, reported as ``ConfigError: <key path>: <message>``.

    >>> raise ConfigError("actor_train.device_mapping", "device 9 does not exist")
    """

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return ' (did you mean 'x'?)' for the closest candidate, or '' when none is close."""
    match = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def table_entry(table: Mapping[str, T], name: str, path: str, kind: str) -> T:
    """``table[name]``; an unknown name is one ConfigError on ``path``: ``unknown <kind> 'x' (did
    you mean ...); valid names: ...``."""
    entry = table.get(name)
    if entry is None:
        raise ConfigError(
            path,
            f"unknown {kind} {name!r}{did_you_mean(str(name), table)}; valid names: {', '.join(sorted(table))}",
        )
    return entry


def join_path(prefix: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else str(key)
