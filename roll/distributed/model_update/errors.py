"""``ModelUpdateError``: an update that did not install the trainer's weights exactly."""

from __future__ import annotations


class ModelUpdateError(RuntimeError):
    """Raised when an engine's weights disagree with the trainer's after an update: a checksum
    mismatch (the message names the first tensor that differs), a probe log-prob difference above
    ``model_update_probe_tolerance``, or a protocol violation (versions, duplicate senders)."""
