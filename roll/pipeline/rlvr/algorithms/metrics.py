"""Per-step metrics named ``<group>/<name>`` (e.g. ``response_length/mean``, ``critic/score/mean/math``).

All functions take CPU or device tensors and return plain floats, ready for the tracker.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from roll.pipeline.rlvr.algorithms.masked import masked_mean


def logprob_mismatch(
    train_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's log-probs are from the ones the inference engine sampled with, on the
    generated tokens. A large value means the rollout is off-policy for reasons other than the
    update (precision, kernels, a stale or broken weight sync).

    ``train_infer/logprob_abs_diff/mean`` and ``/max``: mean and max of ``|logp_train - logp_infer|``;
    ``train_infer/ratio_abs_dev/mean``: mean of ``|exp(logp_train - logp_infer) - 1|``.
    """
    mask = response_mask.to(torch.float32)
    diff = train_log_probs.detach().float() - infer_log_probs.detach().float()
    abs_diff = diff.abs()
    valid = abs_diff[mask > 0]
    return {
        "train_infer/logprob_abs_diff/mean": masked_mean(abs_diff, mask).item(),
        "train_infer/logprob_abs_diff/max": valid.max().item() if valid.numel() else 0.0,
        "train_infer/ratio_abs_dev/mean": masked_mean((torch.exp(diff) - 1).abs(), mask).item(),
    }


def response_length_stats(response_mask: torch.Tensor) -> dict[str, float]:
    """``response_length/{mean,max,min}`` in tokens and ``response_length/clip_ratio``: the
    fraction of responses that filled all R columns (likely cut at max_new_tokens)."""
    lengths = response_mask.detach().float().sum(dim=-1)
    return {
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": (lengths >= response_mask.shape[-1]).float().mean().item(),
    }


def score_stats_by_domain(
    scores: torch.Tensor, domains: Sequence[Any] | np.ndarray | None = None
) -> dict[str, float]:
    """``critic/score/{mean,std,max,min}`` over the batch and ``critic/score/{mean,std}/<domain>``
    per domain (the prompt tag). std is the population std (0 for a single score)."""
    values = scores.detach().float().cpu()
    out = _stats("critic/score", values)
    if domains is None:
        return out
    if len(domains) != values.shape[0]:
        raise ValueError(f"domains: expected {values.shape[0]} entries, got {len(domains)}")
    rows: dict[str, list[int]] = defaultdict(list)
    for i, domain in enumerate(domains):
        rows[str(domain)].append(i)
    for domain, idx in sorted(rows.items()):
        part = values[idx]
        out[f"critic/score/mean/{domain}"] = part.mean().item()
        out[f"critic/score/std/{domain}"] = part.std(correction=0).item()
    return out


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/std": values.std(correction=0).item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def masked_stats(prefix: str, values: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """``<prefix>/{mean,max,min}`` over the valid tokens, e.g. ``masked_stats("critic/advantages", adv, mask)``."""
    mask = response_mask.to(torch.float32)
    valid = values.detach().float()[mask > 0]
    if not valid.numel():
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {
        f"{prefix}/mean": masked_mean(values.detach().float(), mask).item(),
        f"{prefix}/max": valid.max().item(),
        f"{prefix}/min": valid.min().item(),
    }
