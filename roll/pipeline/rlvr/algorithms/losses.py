"""PPO-family losses and the ``LossFn`` factories the training strategies call per micro-batch.

The factories return ``functools.partial`` objects over module-level functions, so the loss
function pickles cheaply when the pipeline sends it to the train workers through Ray::

    loss_fn = make_actor_loss_fn(config)           # LossFn(outputs, micro_batch) -> (loss, metrics)
    metrics = strategy.train_step(micro_batches, loss_fn)

Actor micro-batch fields: ``advantages``, ``response_mask`` (always), ``old_log_probs`` (optional,
see ``actor_loss``), ``ref_log_probs`` (when ``use_kl_loss``), ``is_weights`` or, without old
log-probs, ``infer_logprobs`` (when ``off_policy_correction`` is on). Actor outputs: ``log_probs`` and
``entropy`` ``[b, R]``. Critic: outputs ``values``; micro-batch ``returns``, ``response_mask`` and,
for value clipping, ``values`` (the critic's values before the update).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch

from roll.core.batch import Batch
from roll.core.loss import LossFn
from roll.pipeline.rlvr.algorithms.kl import get_kl_estimator
from roll.pipeline.rlvr.algorithms.masked import agg_loss, masked_mean
from roll.pipeline.rlvr.algorithms.off_policy import correction_weights
from roll.pipeline.rlvr.algorithms.policy_losses import (
    PolicyLossOptions,
    PolicyTerms,
    get_policy_loss,
)

if TYPE_CHECKING:
    from roll.configs.pipeline_config import RLVRConfig


def _masked_frac(condition: torch.Tensor, mask: torch.Tensor) -> float:
    return masked_mean(condition.to(mask.dtype), mask).item()


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    variant: str = "ppo",
    options: PolicyLossOptions | None = None,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The ``variant`` policy loss (``POLICY_LOSSES``; default the PPO clip), aggregated by
    ``loss_agg_mode``. For ppo, with ``r = exp(logp - old_logp)``::

        L_t = max(-A_t * r, -A_t * clamp(r, 1 - clip_low, 1 + clip_high))
        dual clip (A_t < 0 only): L_t = min(L_t, -A_t * dual_clip_c)

    ``is_weights`` (off-policy correction, see algorithms/off_policy.py) multiply ``L_t`` after the
    clipping, as constants. Metrics: ``pg_loss``; for ppo/gspo ``clipfrac`` = fraction of valid tokens
    where the clipped term is the active one (its gradient is zero), split into ``clipfrac_high``
    (r > 1 + clip_high, A > 0) and ``clipfrac_low`` (r < 1 - clip_low, A < 0), ``dual_clip_frac`` =
    fraction where the dual-clip bound is active; each variant's own (policy_losses.py);
    ``approx_kl`` = mean of ``(r - 1) - log r`` (k3 estimate of KL(old || new)); ``ratio_mean``,
    ``ratio_max`` over valid tokens.
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c: must be > 1, got {dual_clip_c}")
    mask = response_mask.to(log_probs.dtype)
    opts = dataclasses.replace(
        options or PolicyLossOptions(), clip_low=clip_low, clip_high=clip_high, dual_clip_c=dual_clip_c
    )
    terms = PolicyTerms(log_probs, old_log_probs, advantages, mask, scores)
    losses, metrics = get_policy_loss(variant)(terms, opts)
    if is_weights is not None:
        losses = losses * is_weights.detach().to(losses.dtype)
    loss = agg_loss(losses, mask, loss_agg_mode)
    with torch.no_grad():
        log_ratio, ratio = terms.log_ratio, terms.ratio
        valid_ratio = ratio[mask > 0]
        metrics["pg_loss"] = loss.item()
        metrics["approx_kl"] = masked_mean((ratio - 1) - log_ratio, mask).item()
        metrics["ratio_mean"] = masked_mean(ratio, mask).item()
        metrics["ratio_max"] = valid_ratio.max().item() if valid_ratio.numel() else 1.0
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor | None,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    value_clip: float | None,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss ``0.5 * agg(max((V - R)^2, (V_clip - R)^2))`` with
    ``V_clip = V_old + clamp(V - V_old, -value_clip, value_clip)``; unclipped ``0.5 * agg((V - R)^2)``
    when ``value_clip`` or ``old_values`` is None. Metrics: ``vf_loss``, ``vf_clipfrac`` (fraction
    of valid tokens where the clipped error is the larger one), ``vpred_mean``."""
    mask = response_mask.to(values.dtype)
    losses = (values - returns).square()
    clip_active = torch.zeros_like(mask, dtype=torch.bool)
    if value_clip is not None and old_values is not None:
        clipped_values = old_values + (values - old_values).clamp(min=-value_clip, max=value_clip)
        clipped_losses = (clipped_values - returns).square()
        clip_active = clipped_losses > losses
        losses = torch.maximum(losses, clipped_losses)
    loss = 0.5 * agg_loss(losses, mask, loss_agg_mode)
    metrics = {
        "vf_loss": loss.item(),
        "vf_clipfrac": _masked_frac(clip_active, mask),
        "vpred_mean": masked_mean(values.detach(), mask).item(),
    }
    return loss, metrics


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
) -> torch.Tensor:
    """KL(policy || reference) per token by estimator ``kl_type``, aggregated by ``loss_agg_mode``."""
    kl = get_kl_estimator(kl_type, "kl_loss_type")(log_probs, ref_log_probs)
    return agg_loss(kl, response_mask.to(kl.dtype), loss_agg_mode)


def entropy_loss(
    entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Mean token entropy by ``loss_agg_mode`` (the actor loss subtracts ``entropy_loss_coef`` times it)."""
    return agg_loss(entropy, response_mask.to(entropy.dtype), loss_agg_mode)


def actor_loss(
    outputs: dict[str, torch.Tensor],
    batch: Batch,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None,
    loss_agg_mode: str,
    entropy_coef: float,
    use_kl_loss: bool,
    kl_loss_coef: float,
    kl_loss_type: str,
    correction: tuple[str, str, float] | None = None,
    variant: str = "ppo",
    options: PolicyLossOptions | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``total = pg_loss - entropy_coef * entropy + kl_loss_coef * kl_loss`` (KL only when ``use_kl_loss``).

    Without ``old_log_probs`` in the micro-batch (one update per rollout batch: the forward before
    the update gives them, see ``recompute_old_log_probs``) the ratio uses the detached current
    log-probs: r == 1 in value, but its gradient is the policy gradient ``-A * grad log pi``. The
    off-policy weights (``correction`` = off_policy_correction's (mode, level, cap)) are then
    computed here from those same detached log-probs and ``infer_logprobs``; with old log-probs
    the micro-batch brings them as ``is_weights``.
    """
    log_probs = outputs["log_probs"]
    mask = batch["response_mask"]
    recorded = "old_log_probs" not in batch
    old_log_probs = log_probs.detach() if recorded else batch["old_log_probs"]
    weights = batch["is_weights"] if "is_weights" in batch else None
    if weights is None and recorded and correction is not None:
        weights = correction_weights(old_log_probs, batch["infer_logprobs"], mask, *correction)
    loss, pg_metrics = policy_loss(
        log_probs,
        old_log_probs,
        batch["advantages"],
        mask,
        clip_low,
        clip_high,
        dual_clip_c,
        loss_agg_mode,
        weights,
        variant,
        options,
        batch["scores"] if "scores" in batch else None,
    )
    metrics = {f"actor/{k}": v for k, v in pg_metrics.items()}
    if entropy_coef != 0.0 or "entropy" in outputs:
        if "entropy" not in outputs:
            raise KeyError("entropy_loss_coef != 0 needs outputs['entropy'] from the train strategy")
        entropy = entropy_loss(outputs["entropy"], mask, loss_agg_mode)
        metrics["actor/entropy"] = entropy.item()
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * entropy
    if use_kl_loss:
        kl = kl_loss(log_probs, batch["ref_log_probs"], mask, kl_loss_type, loss_agg_mode)
        loss = loss + kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl.item()
        metrics["actor/kl_coef"] = float(kl_loss_coef)
    metrics["actor/total_loss"] = loss.item()
    return loss, metrics


def critic_loss(
    outputs: dict[str, torch.Tensor], batch: Batch, *, value_clip: float | None, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of ``outputs['values']`` against ``batch['returns']`` (see ``value_loss``)."""
    old_values = batch["values"] if "values" in batch else None
    loss, metrics = value_loss(
        outputs["values"], old_values, batch["returns"], batch["response_mask"], value_clip, loss_agg_mode
    )
    return loss, {f"critic/{k}": v for k, v in metrics.items()}


def clip_range(config: RLVRConfig) -> tuple[float, float]:
    """``(clip_low, clip_high)``: ``pg_clip_low`` / ``pg_clip_high``, each defaulting to ``pg_clip``."""
    low = config.pg_clip if config.pg_clip_low is None else config.pg_clip_low
    high = config.pg_clip if config.pg_clip_high is None else config.pg_clip_high
    for key, value in (("pg_clip_low", low), ("pg_clip_high", high)):
        if value < 0:
            raise ValueError(f"{key}: must be >= 0, got {value}")
    return low, high


def make_actor_loss_fn(config: RLVRConfig) -> LossFn:
    """The actor's ``LossFn`` for ``config`` (picklable; checks the config keys it reads now)."""
    clip_low, clip_high = clip_range(config)
    dual_clip_c = config.dual_clip_c if config.dual_clip_loss else None
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c: must be > 1, got {dual_clip_c}")
    if config.use_kl_loss:
        get_kl_estimator(config.kl_loss_type, "kl_loss_type")
    off_policy = config.off_policy_correction
    correction = None if off_policy.mode == "none" else (off_policy.mode, off_policy.level, off_policy.cap)
    get_policy_loss(config.pg_variant)
    return functools.partial(
        actor_loss,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
        loss_agg_mode=config.loss_agg_mode,
        entropy_coef=float(config.entropy_loss_coef),
        use_kl_loss=config.use_kl_loss,
        kl_loss_coef=float(config.kl_loss_coef),
        kl_loss_type=config.kl_loss_type,
        correction=correction,
        variant=config.pg_variant,
        options=PolicyLossOptions(**dataclasses.asdict(config.policy_loss)),
    )


def make_critic_loss_fn(config: RLVRConfig) -> LossFn:
    """The critic's ``LossFn`` for ``config`` (``value_clip``, ``loss_agg_mode``); picklable."""
    if config.value_clip is not None and config.value_clip <= 0:
        raise ValueError(f"value_clip: must be > 0 or null, got {config.value_clip}")
    return functools.partial(critic_loss, value_clip=config.value_clip, loss_agg_mode=config.loss_agg_mode)
