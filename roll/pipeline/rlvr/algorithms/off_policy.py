"""Train/inference mismatch correction: importance weights ``pi_train / pi_infer`` per token.

The engine samples with its own kernels (and, asynchronously, with older weights), so the tokens
come from ``pi_infer`` while the loss assumes ``pi_train``. Weighting each token's policy-gradient
term by ``w = exp(old_log_probs - infer_logprobs)`` corrects that; capping it bounds the variance::

    tis, token:     w_t = min(r_t, cap)
    mis, token:     w_t = r_t if r_t <= cap else 0
    tis, sequence:  w_t = min(prod_t r_t, cap)           (one weight per response)
    mis, sequence:  w_t = prod_t r_t if it is <= cap else 0

    weights, metrics = importance_weights(old_lp, infer_lp, mask, "tis", "token", 2.0)
"""

from __future__ import annotations

import torch

from roll.pipeline.rlvr.algorithms.masked import masked_mean, masked_sum

LOG_RATIO_BOUND = 20.0
# ``off_policy_correction.mode`` ("none": no weights) and ``.level``, as implemented below.
CORRECTION_MODES = ("none", "tis", "mis")
CORRECTION_LEVELS = ("token", "sequence")


def importance_weights(
    old_log_probs: torch.Tensor,
    infer_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    level: str,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weights ``[B, R]`` (0 on padding) and metrics of the raw ratio and of the correction:
    ``off_policy/ratio_{mean,min,max,p50,p95}`` over the tokens (or sequences), ``off_policy/capped_frac``
    (share truncated or masked) and ``off_policy/weight_mean``."""
    weights, samples = _weights(old_log_probs, infer_logprobs, response_mask, mode, level, cap)
    mask = response_mask.to(old_log_probs.dtype)
    return weights, _ratio_metrics(samples, cap) | {
        "off_policy/weight_mean": masked_mean(weights, mask).item()
    }


def correction_weights(
    old_log_probs: torch.Tensor,
    infer_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    level: str,
    cap: float,
) -> torch.Tensor:
    """The weights of ``importance_weights`` alone (no metrics): a row's weights depend on that row
    only, so a micro-batch's are those of the whole batch (the loss computes them per micro-batch
    when the old log-probs come from its own forward)."""
    return _weights(old_log_probs, infer_logprobs, response_mask, mode, level, cap)[0]


def _weights(
    old_log_probs: torch.Tensor,
    infer_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    level: str,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, R], the raw ratios the metrics describe: per valid token or per sequence)."""
    mask = response_mask.to(old_log_probs.dtype)
    log_ratio = (old_log_probs - infer_logprobs) * mask
    if level == "sequence":
        seq = masked_sum(log_ratio, mask, dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratio = torch.exp(seq).unsqueeze(-1).expand_as(mask)
        valid = mask.sum(-1) > 0
        samples = torch.exp(seq)[valid]
    elif level == "token":
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        samples = ratio[mask > 0]
    else:
        raise ValueError(f"level: expected 'token' or 'sequence', got {level!r}")
    over = ratio > cap
    if mode == "tis":
        weights = ratio.clamp(max=cap)
    elif mode == "mis":
        weights = torch.where(over, torch.zeros_like(ratio), ratio)
    else:
        raise ValueError(f"mode: expected 'tis' or 'mis', got {mode!r}")
    return weights * mask, samples


def _ratio_metrics(samples: torch.Tensor, cap: float) -> dict[str, float]:
    if samples.numel() == 0:
        return {}
    samples = samples.float()
    quantiles = torch.quantile(samples, torch.tensor([0.5, 0.95]))
    return {
        "off_policy/ratio_mean": samples.mean().item(),
        "off_policy/ratio_min": samples.min().item(),
        "off_policy/ratio_max": samples.max().item(),
        "off_policy/ratio_p50": quantiles[0].item(),
        "off_policy/ratio_p95": quantiles[1].item(),
        "off_policy/capped_frac": (samples > cap).float().mean().item(),
    }
