"""Sampling and off-policy options of an RLVR run: DAPO dynamic sampling, overlong shaping and
filtering, and train/inference mismatch correction (TIS / MIS). Each is one small dataclass under
its own YAML key of ``RLVRConfig``; every option is off by default.

    dynamic_sampling: {enabled: true, max_rounds: 4}
    overlong: {buffer_length: 8, penalty_factor: 1.0, filter: false}
    off_policy_correction: {mode: tis, level: token, cap: 2.0}
"""

from __future__ import annotations

from dataclasses import dataclass

CORRECTION_MODES = ("none", "tis", "mis")
CORRECTION_LEVELS = ("token", "sequence")


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: prompt groups whose rewards are all equal carry no GRPO signal and are
    dropped; more prompts are drawn (at most ``max_rounds`` generation rounds per step, the first
    included) until ``rollout_batch_size`` informative groups are collected. A step still short
    after the last round fills up with dropped groups (zero advantage), so batch shapes never change.
    """

    enabled: bool = False
    max_rounds: int = 4

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds: must be >= 1, got {self.max_rounds}")


@dataclass
class OverlongConfig:
    """DAPO overlong handling. ``buffer_length`` > 0 adds a soft penalty to the score of responses
    longer than ``response_length - buffer_length``: linear from 0 to ``-penalty_factor`` at
    ``response_length``. ``filter`` drops truncated responses (no end-of-sequence token within
    ``response_length``) from the loss."""

    buffer_length: int = 0
    penalty_factor: float = 1.0
    filter: bool = False

    def __post_init__(self) -> None:
        if self.buffer_length < 0:
            raise ValueError(f"buffer_length: must be >= 0, got {self.buffer_length}")
        if self.penalty_factor < 0:
            raise ValueError(f"penalty_factor: must be >= 0, got {self.penalty_factor}")


@dataclass
class OffPolicyCorrectionConfig:
    """Importance weights ``pi_train / pi_infer`` from the trainer's ``old_log_probs`` and the
    engine's ``infer_logprobs``, multiplied into the policy loss. ``mode``: ``tis`` truncates the
    weight at ``cap``; ``mis`` masks (weight 0) where it exceeds ``cap``. ``level``: per ``token``, or
    one weight per ``sequence`` from the summed log-ratio."""

    mode: str = "none"
    level: str = "token"
    cap: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"mode: expected one of {list(CORRECTION_MODES)}, got {self.mode!r}")
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(f"level: expected one of {list(CORRECTION_LEVELS)}, got {self.level!r}")
        if self.cap <= 0:
            raise ValueError(f"cap: must be > 0, got {self.cap}")
