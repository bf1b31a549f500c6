"""Sampling and off-policy options of an RLVR run: DAPO dynamic sampling, overlong shaping and
filtering, and train/inference mismatch correction (TIS / MIS). Each is one small dataclass under
its own YAML key of ``RLVRConfig``; every option is off by default.

    dynamic_sampling: {enabled: true, max_rounds: 4}
    overlong: {buffer_length: 8, penalty_factor: 1.0, filter: false}
    off_policy_correction: {mode: tis, level: token, cap: 2.0}
    policy_loss: {cispo_epsilon_low: 0.1, cispo_epsilon_high: 0.2}   # options of pg_variant's loss
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


@dataclass
class PolicyLossConfig:
    """Options of the ``pg_variant`` losses, under alibaba/ROLL's key names (docs/policy_losses.md;
    roll.pipeline.rlvr.algorithms.policy_losses). Each variant reads its own; ppo and gspo read
    the top-level ``pg_clip*`` and ``dual_clip_*`` keys instead."""

    # tis: the ratio is truncated to [tis_lower_bound, tis_upper_bound] and used as a constant weight.
    tis_lower_bound: float = bounded(0.0, ge=0)
    tis_upper_bound: float = bounded(1.0, gt=0)
    # topr: weights of the responses scoring > 0 (plain update) and <= 0 (ratio truncated to [0, 1]).
    topr_positive_weight: float = bounded(1.0, ge=0)
    topr_negative_weight: float = bounded(1.0, ge=0)
    # cispo: the ratio clipped to [1 - epsilon_low, 1 + epsilon_high] is a constant weight;
    # unified mask: tokens PPO would clip (A > 0 above, A < 0 below the range) leave the loss.
    cispo_epsilon_low: float = bounded(0.1, ge=0, le=1)
    cispo_epsilon_high: float = bounded(0.1, ge=0)
    cispo_use_unified_mask: bool = False
    # kimi15: weight of the squared log-ratio penalty tau / 2 * (logp - old_logp)^2.
    kimi15_tau: float = bounded(0.1, ge=0)

    def __post_init__(self) -> None:
        if self.tis_lower_bound >= self.tis_upper_bound:
            raise ValueError(
                f"tis_lower_bound: must be below tis_upper_bound ({self.tis_lower_bound} >= {self.tis_upper_bound})"
            )
