"""Errors of a running job, each reported to the user as one line; the launcher maps each to an exit
code. ``StorageError`` and ``CheckpointError`` name a file, ``RewardError`` a reward role. Problems in
the configuration are ``roll.configs.errors.ConfigError``."""

from __future__ import annotations


class StorageError(RuntimeError):
    """A file of the run could not be written or read back, reported as one line naming the file.

    >>> raise StorageError("out/metrics.jsonl: No space left on device (out/metrics.jsonl)")
    """


class CheckpointError(StorageError):
    """A checkpoint that cannot be trusted or does not fit the model: a step checkpoint
    (``<checkpoint dir>/<file>: <what>``) or an HF checkpoint a Megatron model is built from (names the
    tensor and file).

    >>> raise CheckpointError("out/checkpoints/step_4/pipeline_state.json: size 812, manifest says 830")
    """


class RewardError(RuntimeError):
    """A reward role failed on too many samples: names the role, the function and one example error."""


class RolloutDumpError(StorageError):
    """A rollout dump (``rollout_dump``) that cannot be written or read back: names the file and what
    is wrong with it.

    >>> raise RolloutDumpError("dumps/v1/step_3.safetensors: sha256 differs from manifest.json (corrupted)")
    """
