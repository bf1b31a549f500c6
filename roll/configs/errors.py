"""Errors reported to the user as one line: ``ConfigError`` (a key path), ``StorageError`` and
``CheckpointError`` (a file), ``RewardError`` (a reward role). The launcher maps each to an exit code."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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


def join_path(prefix: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else str(key)


class StorageError(RuntimeError):
    """A file of the run could not be written or read back, reported as one line naming the file.

    >>> raise StorageError("out/metrics.jsonl: No space left on device (out/metrics.jsonl)")
    """


class CheckpointError(StorageError):
    """A step checkpoint that cannot be trusted: ``CheckpointError: <checkpoint dir>/<file>: <what>``.

    >>> raise CheckpointError("out/checkpoints/step_4/pipeline_state.json: size 812, manifest says 830")
    """


class RewardError(RuntimeError):
    """A reward role failed on too many samples: names the role, the function and one example error."""
