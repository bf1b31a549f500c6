"""The policy-gradient losses ``pg_variant`` names (alibaba/ROLL's ActorPGWorker variants, plus
GSPO's sequence-level ratio), one registered function each.

Each function maps the token tensors of one micro-batch to the per-token loss ``[B, R]`` (before
the off-policy weights and ``loss_agg_mode``) and its metrics. With ``r = exp(logp - old_logp)``
and ``sg`` = stop-gradient (docs/policy_losses.md has the papers and the options)::

    ppo:     max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high))    (+ dual clip)
    gspo:    ppo with s = exp(mean_t(logp - old_logp)) per sequence in place of r
    vanilla: -A logp
    tis:     -sg(clamp(r, tis_lower_bound, tis_upper_bound)) A logp
    topr:    score > 0: -w+ A logp;  score <= 0: -w- sg(clamp(r, 0, 1)) A logp
    cispo:   -sg(clamp(r, 1 - eps_low, 1 + eps_high)) A logp  (x the unified mask, optionally)
    kimi15:  -A logp + tau / 2 (logp - old_logp)^2

    losses, metrics = POLICY_LOSSES["cispo"](terms, options)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from roll.pipeline.rlvr.algorithms.masked import masked_mean

# exp() of log-ratios beyond this bound overflows fp32 long before it means anything.
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class PolicyLossOptions:
    """Every variant's options (a variant reads its own). ``clip_*``/``dual_clip_c``: ppo and gspo
    (``pg_clip_low``/``pg_clip_high``/``dual_clip_c``); the rest keep ROLL's key names."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = None
    tis_lower_bound: float = 0.0
    tis_upper_bound: float = 1.0
    topr_positive_weight: float = 1.0
    topr_negative_weight: float = 1.0
    cispo_epsilon_low: float = 0.1
    cispo_epsilon_high: float = 0.1
    cispo_use_unified_mask: bool = False
    kimi15_tau: float = 0.1


@dataclass(frozen=True)
class PolicyTerms:
    """One micro-batch's inputs: ``log_probs`` (with gradient), ``old_log_probs``, ``advantages``,
    ``mask`` (float) ``[B, R]``; ``scores`` ``[B]`` (the samples' rewards, read by topr)."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    scores: torch.Tensor | None = None

    @functools.cached_property
    def log_ratio(self) -> torch.Tensor:
        return (self.log_probs - self.old_log_probs).clamp(min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)

    @functools.cached_property
    def ratio(self) -> torch.Tensor:
        """exp(log_ratio), with gradient; computed once per micro-batch for the loss and its metrics."""
        return torch.exp(self.log_ratio)

    def frac(self, condition: torch.Tensor) -> float:
        """Share of the valid tokens where ``condition`` holds."""
        return masked_mean(condition.to(self.mask.dtype), self.mask).item()


LossTerms = tuple[torch.Tensor, dict[str, float]]


def _clipped(terms: PolicyTerms, ratio: torch.Tensor, opts: PolicyLossOptions) -> LossTerms:
    """The PPO objective on ``ratio`` (token- or sequence-level)."""
    adv = terms.advantages
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(min=1.0 - opts.clip_low, max=1.0 + opts.clip_high)
    losses = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    metrics = {
        "clipfrac": terms.frac(active),
        "clipfrac_high": terms.frac(active & (adv > 0)),
        "clipfrac_low": terms.frac(active & (adv < 0)),
        "dual_clip_frac": 0.0,
    }
    if opts.dual_clip_c is not None:
        bound = -adv * opts.dual_clip_c
        metrics["dual_clip_frac"] = terms.frac((adv < 0) & (losses > bound))
        losses = torch.where(adv < 0, torch.minimum(losses, bound), losses)
    return losses, metrics


def ppo_loss(terms: PolicyTerms, opts: PolicyLossOptions) -> LossTerms:
    return _clipped(terms, terms.ratio, opts)


def gspo_loss(terms: PolicyTerms, opts: PolicyLossOptions) -> LossTerms:
    """GSPO: one ratio per response, the geometric mean of its token ratios, clipped as in PPO."""
    seq = masked_mean(terms.log_probs - terms.old_log_probs, terms.mask, dim=-1)
    ratio = torch.exp(seq.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).unsqueeze(-1).expand_as(terms.mask)
    return _clipped(terms, ratio, opts)


def vanilla_loss(terms: PolicyTerms, opts: PolicyLossOptions) -> LossTerms:
    return -terms.advantages * terms.log_probs, {}


def _truncated(terms: PolicyTerms, low: float, high: float, prefix: str) -> tuple[torch.Tensor, dict]:
    ratio = terms.ratio.detach()
    below, above = ratio < low, ratio > high
    metrics = {f"{prefix}_lower_clipfrac": terms.frac(below), f"{prefix}_upper_clipfrac": terms.frac(above)}
    return ratio.clamp(min=low, max=high), metrics


def tis_loss(terms: PolicyTerms, opts: PolicyLossOptions) -> LossTerms:
    weight, metrics = _truncated(terms, opts.tis_lower_bound, opts.tis_upper_bound, "tis")
    return -weight * terms.advantages * terms.log_probs, metrics


def topr_loss(terms: PolicyTerms, opts: PolicyLossOptions) -> LossTerms:
    """TOPR: responses with a positive score get the plain (SFT-like) update, the others the
    ratio truncated to [0, 1]; each side scaled by its weight."""
    if terms.scores is None:
        raise KeyError("pg_variant topr needs the samples' 'scores' in the training batch")
    positive = (terms.scores > 0).unsqueeze(-1).to(terms.log_probs.dtype)
    weight, metrics = _truncated(terms, 0.0, 1.0, "topr_negative")
    per_token = positive * opts.topr_positive_weight + (1 - positive) * opts.topr_negative_weight * weight
    metrics["topr_positive_frac"] = positive.mean().item()
    return -per_token * terms.advantages * terms.log_probs, metrics


def cispo_loss(terms: PolicyTerms, opts: PolicyLossOptions) -> LossTerms:
    low, high = 1.0 - opts.cispo_epsilon_low, 1.0 + opts.cispo_epsilon_high
    weight, metrics = _truncated(terms, low, high, "cispo")
    losses = -weight * terms.advantages * terms.log_probs
    if opts.cispo_use_unified_mask:
        ratio, adv = terms.ratio.detach(), terms.advantages
        dropped = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
        losses = losses * (~dropped).to(losses.dtype)
        metrics["cispo_masked_frac"] = terms.frac(dropped)
    return losses, metrics


def kimi15_loss(terms: PolicyTerms, opts: PolicyLossOptions) -> LossTerms:
    log_ratio = terms.log_probs - terms.old_log_probs
    penalty = 0.5 * opts.kimi15_tau * log_ratio.square()
    metrics = {"kimi15_penalty": masked_mean(penalty.detach(), terms.mask).item()}
    return -terms.advantages * terms.log_probs + penalty, metrics


# pg_variant -> per-token loss. ppo is roll's default; the rest as in alibaba/ROLL (gspo: verl's
# policy_loss.loss_mode gspo, ROLL's ratio_type segment).
POLICY_LOSSES: dict[str, Callable[[PolicyTerms, PolicyLossOptions], LossTerms]] = {
    "ppo": ppo_loss,
    "gspo": gspo_loss,
    "vanilla": vanilla_loss,
    "tis": tis_loss,
    "topr": topr_loss,
    "cispo": cispo_loss,
    "kimi15": kimi15_loss,
}

# Variants that read the samples' rewards: the training batch must carry ``scores``.
READS_SCORES = frozenset({"topr"})


def get_policy_loss(name: str) -> Callable[[PolicyTerms, PolicyLossOptions], LossTerms]:
    if name not in POLICY_LOSSES:
        raise ValueError(f"pg_variant: unknown {name!r}; known: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]
