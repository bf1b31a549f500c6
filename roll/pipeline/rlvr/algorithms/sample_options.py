"""alibaba/ROLL's per-sample options: score normalisation, sample masks and length weights.

Each is a pure function over response-level tensors so tests can check it by hand; the
advantage stage applies them in ROLL's order::

    scores --normalize_scores (norm_mean_type, norm_std_type)--> then reward_clip, whiten_rewards, ...
    sample_mask (max_len_mask, difficulty_mask, error_max_len_clip) [B] -> multiplies response_mask
        for the training loss (masked samples add no tokens to the loss and its normaliser)
    length_weights (length_loss_weight) [B] -> multiplies the advantages; for the clipped PPO
        objective a positive per-sample factor on the advantage equals that factor on the sample's
        policy-gradient loss (KL and entropy terms are not weighted)

Example::

    scores = normalize_scores(scores, group_ids, "group", "group")
    keep, metrics = sample_mask(config, scores, response_mask, group_ids)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from roll.pipeline.rlvr.algorithms.advantages import GroupIds, group_index

if TYPE_CHECKING:
    from roll.configs.pipeline_config import RLVRConfig

NORM_TYPES = (None, "batch", "group")
# ROLL names this framework does not implement, with the reason (checked before launch).
NORM_REFUSED: dict[str, str] = {"running": "is not supported (ROLL's running statistics across steps)"}
NORM_EPS = 1e-6


def _group_stats(scores: torch.Tensor, group_ids: GroupIds) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and unbiased std of the row's group (std 0 for single-row groups)."""
    index = group_index(group_ids).to(scores.device)
    groups = int(index.max()) + 1 if len(index) else 0
    count = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, torch.ones_like(scores))
    mean = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, scores) / count
    sq = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, (scores - mean[index]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt() * (count > 1)
    return mean[index], std[index]


def normalize_scores(
    scores: torch.Tensor, group_ids: GroupIds, mean_type: str | None, std_type: str | None
) -> torch.Tensor:
    """``(scores - mean) / (std + 1e-6)``; ``mean_type`` / ``std_type`` pick the batch's or each
    prompt group's statistics (None: subtract nothing / divide by nothing). Std is unbiased."""
    for name, kind in (("norm_mean_type", mean_type), ("norm_std_type", std_type)):
        if kind not in NORM_TYPES:
            raise ValueError(f"{name}: expected one of {list(NORM_TYPES)}, got {kind!r}")
    scores = scores.to(torch.float32)
    stats = {"batch": (scores.mean(), scores.std() if len(scores) > 1 else torch.tensor(0.0))}
    if "group" in (mean_type, std_type):
        stats["group"] = _group_stats(scores, group_ids)
    out = scores - (stats[mean_type][0] if mean_type else 0.0)
    if std_type:
        out = out / (stats[std_type][1] + NORM_EPS)
    return out


def sample_mask(
    config: RLVRConfig, scores: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B]`` 1.0 for samples that train, 0.0 for masked ones, and the kept ratio per mask.

    - ``max_len_mask``: drop responses that reached ``response_length`` (cut off, not finished);
    - ``difficulty_mask``: keep groups whose mean score is strictly between
      ``difficulty_low_threshold`` and ``difficulty_high_threshold`` (groups of one are kept);
    - ``error_max_len_clip``: keep score-1 samples and score-0 samples shorter than
      ``error_max_len_threshold`` tokens (as in ROLL, other scores are dropped too).
    """
    lengths = response_mask.sum(dim=-1).to(torch.float32)
    scores = scores.to(torch.float32)
    keep = torch.ones_like(lengths)
    metrics: dict[str, float] = {}
    if config.max_len_mask:
        part = (lengths < config.response_length).float()
        keep, metrics["actor/max_len_mask_ratio"] = keep * part, part.mean().item()
    if config.difficulty_mask:
        mean, _ = _group_stats(scores, group_ids)
        sizes = torch.bincount(group_index(group_ids))[group_index(group_ids)]
        low, high = config.difficulty_low_threshold, config.difficulty_high_threshold
        part = (((mean > low) & (mean < high)) | (sizes < 2)).float()
        keep, metrics["actor/difficulty_mask_ratio"] = keep * part, part.mean().item()
    if config.error_max_len_clip:
        part = (((scores == 0) & (lengths < config.error_max_len_threshold)) | (scores == 1)).float()
        keep, metrics["actor/error_len_mask_ratio"] = keep * part, part.mean().item()
    if metrics:
        metrics["actor/samples_used"] = keep.sum().item()
    return keep, metrics


def length_weights(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` weights ``1.5 - (len - min) / (max - min)`` (shorter responses weigh more, in
    [0.5, 1.5]), rescaled to mean 1 over the batch."""
    lengths = response_mask.sum(dim=-1).to(torch.float32)
    span = lengths.max() - lengths.min()
    weights = 1.5 - (lengths - lengths.min()) / (span + 1e-8)
    return weights * (len(weights) / (weights.sum() + 1e-8))


def apply_sample_options(
    config: RLVRConfig,
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    advantages: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The training loss mask and advantages after the sample masks and length weights."""
    keep, metrics = sample_mask(config, scores, response_mask, group_ids)
    if config.length_loss_weight:
        advantages = advantages * length_weights(response_mask)[:, None].to(advantages.dtype)
    return response_mask * keep[:, None].to(response_mask.dtype), advantages, metrics
