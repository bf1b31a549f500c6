"""Sampling and off-policy options of an RLVR run: DAPO dynamic sampling, overlong shaping and
filtering, and train/inference mismatch correction (TIS / MIS). Each is one small dataclass under
its own YAML key of ``RLVRConfig``; every option is off by default.

    dynamic_sampling: {enabled: true, max_rounds: 4}
    overlong: {buffer_length: 8, penalty_factor: 1.0, filter: false}
    off_policy_correction: {mode: tis, level: token, cap: 2.0}
"""

from __future__ import annotations

from dataclasses import dataclass

from roll.configs.ranges import bounded, one_of

# Named values come from the table that implements them (see roll.configs.ranges).
_OFF_POLICY = "roll.pipeline.rlvr.algorithms.off_policy"


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: prompt groups whose rewards are all equal carry no GRPO signal and are
    dropped; more prompts are drawn (at most ``max_rounds`` generation rounds per step, the first
    included) until ``rollout_batch_size`` informative groups are collected. A step still short
    after the last round fills up with dropped groups (zero advantage), so batch shapes never change.
    """

    enabled: bool = False
    max_rounds: int = bounded(4, ge=1)


@dataclass
class OverlongConfig:
    """DAPO overlong handling. ``buffer_length`` > 0 adds a soft penalty to the score of responses
    longer than ``response_length - buffer_length``: linear from 0 to ``-penalty_factor`` at
    ``response_length``. ``filter`` drops truncated responses (no end-of-sequence token within
    ``response_length``) from the loss."""

    buffer_length: int = bounded(0, ge=0)
    penalty_factor: float = bounded(1.0, ge=0)
    filter: bool = False


@dataclass
class OffPolicyCorrectionConfig:
    """Importance weights ``pi_train / pi_infer`` from the trainer's ``old_log_probs`` and the
    engine's ``infer_logprobs``, multiplied into the policy loss. ``mode``: ``tis`` truncates the
    weight at ``cap``; ``mis`` masks (weight 0) where it exceeds ``cap``. ``level``: per ``token``, or
    one weight per ``sequence`` from the summed log-ratio."""

    mode: str = one_of("none", table=f"{_OFF_POLICY}:CORRECTION_MODES")
    level: str = one_of("token", table=f"{_OFF_POLICY}:CORRECTION_LEVELS")
    cap: float = bounded(2.0, gt=0)
