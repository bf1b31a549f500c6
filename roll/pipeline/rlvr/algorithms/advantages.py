"""From response scores to token-level rewards, then to advantages and returns.

Pipeline order (each step is a pure function so tests can check it by hand)::

    scores [B] --clip (reward_clip)--> --whiten (whiten_rewards)--> on the last valid token
      - kl_coef * kl [B, R] (add_token_level_kl)                    = token_level_rewards [B, R]
    token_level_rewards --estimator (adv_estimator)--> advantages, returns [B, R]
      --whiten (whiten_advantages)--> --clip (advantage_clip)--> zero on padding

Example::

    rewards, metrics = token_level_rewards_from_config(config, scores, batch["response_mask"],
                                                       batch["old_log_probs"], batch["ref_log_probs"])
    advantages, returns = compute_advantages(config, rewards, batch["response_mask"], batch["uid"])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from roll.pipeline.rlvr.algorithms.kl import get_kl_estimator
from roll.pipeline.rlvr.algorithms.masked import masked_mean, masked_sum, masked_whiten

if TYPE_CHECKING:
    from roll.configs.pipeline_config import RLVRConfig

GroupIds = torch.Tensor | np.ndarray | Sequence[Any]
# (config, token_level_rewards, response_mask, group_ids, values) -> (advantages, returns)
Estimator = Callable[["RLVRConfig", torch.Tensor, torch.Tensor, Any, "torch.Tensor | None"], tuple]

GRPO_EPS = 1e-6


def clip_scores(scores: torch.Tensor, reward_clip: float | None) -> torch.Tensor:
    """Scores clamped to ``[-reward_clip, reward_clip]`` (unchanged when None)."""
    if reward_clip is None:
        return scores
    if reward_clip <= 0:
        raise ValueError(f"reward_clip: must be > 0, got {reward_clip}")
    return scores.clamp(min=-reward_clip, max=reward_clip)


def whiten_scores(scores: torch.Tensor) -> torch.Tensor:
    """Scores shifted to mean 0 and scaled to unit (unbiased) std over the batch.

    ``whiten_rewards`` acts on the response-level scores, not on the token-level rewards: outcome
    rewards sit on one token per response, and whitening the mostly-zero token matrix would make
    the scale depend on response lengths.
    """
    return masked_whiten(scores, torch.ones_like(scores))


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Column of the last valid token of each row ``[B]`` (0 for rows without valid tokens)."""
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    return (positions * (response_mask > 0)).argmax(dim=-1)


def compute_token_level_rewards(
    scores: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """``[B, R]`` rewards: each score on its response's last valid token, minus ``kl_coef * kl``
    on every valid token when ``kl`` (per-token KL, ``[B, R]``) is given. Padding stays 0."""
    mask = response_mask.to(torch.float32)
    rewards = torch.zeros_like(mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    has_tokens = mask.sum(dim=-1) > 0
    rewards[rows, last_token_index(mask)] = scores.to(torch.float32) * has_tokens
    if kl is not None:
        rewards = rewards - kl_coef * kl.to(torch.float32) * mask
    return rewards


def token_level_rewards_from_config(
    config: RLVRConfig,
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip and whiten scores per ``config`` and place them on tokens, with the KL penalty
    (``kl_penalty`` estimator, fixed coefficient ``init_kl_coef``) when ``add_token_level_kl``.

    Returns the rewards and metrics ``critic/kl`` (mean per-token KL) and ``critic/kl_coef``.
    """
    scores = clip_scores(scores.to(torch.float32), config.reward_clip)
    if config.whiten_rewards:
        scores = whiten_scores(scores)
    if not config.add_token_level_kl:
        return compute_token_level_rewards(scores, response_mask), {}
    if log_probs is None or ref_log_probs is None:
        raise ValueError(
            "add_token_level_kl: needs log_probs and ref_log_probs (configure the reference role)"
        )
    kl = get_kl_estimator(config.kl_penalty, "kl_penalty")(log_probs.float(), ref_log_probs.float())
    rewards = compute_token_level_rewards(scores, response_mask, kl, config.init_kl_coef)
    mean_kl = masked_mean(kl, response_mask.to(kl.dtype)).item()
    return rewards, {"critic/kl": mean_kl, "critic/kl_coef": float(config.init_kl_coef)}


def discounted_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over valid tokens (masked positions are skipped), 0 on padding."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[-1])):
        step = token_level_rewards[:, t] + gamma * running
        running = mask[:, t] * step + (1 - mask[:, t]) * running
        returns[:, t] = running
    return returns * mask


def group_index(group_ids: GroupIds) -> torch.Tensor:
    """Dense group indices ``[B]`` (0..G-1) from any ids (uid strings, ints, a tensor)."""
    ids = group_ids.cpu().numpy() if isinstance(group_ids, torch.Tensor) else np.asarray(group_ids)
    _, inverse = np.unique(ids, return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long)


def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    norm_by_std: bool = True,
    eps: float = GRPO_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: ``(s - mean_g) / (std_g + eps)`` (or ``s - mean_g`` without std
    normalisation), with ``s`` the summed reward of a response and ``g`` its group, broadcast over
    the response tokens. ``std_g`` is the unbiased std; a group of one response (or identical
    scores) gets advantage 0 rather than NaN. Returns ``(advantages, advantages)``."""
    mask = response_mask.to(torch.float32)
    scores = masked_sum(token_level_rewards.float(), mask, dim=-1)
    index = group_index(group_ids).to(scores.device)
    if index.shape[0] != scores.shape[0]:
        raise ValueError(f"group_ids: expected {scores.shape[0]} ids, got {index.shape[0]}")
    counts = torch.bincount(index).to(scores.dtype)
    mean = torch.zeros_like(counts).index_add_(0, index, scores) / counts
    centered = scores - mean[index]
    if norm_by_std:
        sq_sum = torch.zeros_like(counts).index_add_(0, index, centered.square())
        std = torch.where(counts > 1, (sq_sum / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(counts))
        centered = centered / (std[index] + eps)
    advantages = centered.unsqueeze(-1) * mask
    return advantages, advantages


def reinforce_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain REINFORCE with a batch-mean baseline: ``A_t = G_t - mean_b(G_b)``, where ``G_t`` are
    discounted returns and ``G_b`` the return of response b from its first token (mean over the
    responses that have tokens). With gamma=1 and no KL this is ``score_b - mean(scores)``; no std
    scaling. Returns ``(advantages, G)``."""
    mask = response_mask.to(torch.float32)
    returns = discounted_returns(token_level_rewards.float(), mask, gamma)
    rows = torch.arange(mask.shape[0], device=mask.device)
    first = (mask > 0).to(torch.int64).argmax(dim=-1)
    has_tokens = (mask.sum(dim=-1) > 0).to(mask.dtype)
    baseline = (returns[rows, first] * has_tokens).sum() / has_tokens.sum().clamp(min=1)
    return (returns - baseline) * mask, returns


def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): token-level discounted returns ``G_t`` (the KL penalty is part of
    the rewards), whitened over every valid token of the batch. Returns ``(advantages, G)``."""
    mask = response_mask.to(torch.float32)
    returns = discounted_returns(token_level_rewards.float(), mask, gamma)
    return masked_whiten(returns, mask) * mask, returns


def gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016), backwards over valid tokens::

        delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last valid token is 0)
        A_t     = delta_t + gamma * lambd * A_{t+1}
        returns = A + V

    Masked positions are skipped (the next valid token's value and advantage carry across them)
    and are 0 in the outputs."""
    mask = response_mask.to(torch.float32)
    rewards, values = token_level_rewards.float(), values.float()
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lambd * next_adv
        valid = mask[:, t]
        next_adv = valid * adv + (1 - valid) * next_adv
        next_value = valid * values[:, t] + (1 - valid) * next_value
        advantages[:, t] = next_adv
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def _grpo(
    config: RLVRConfig, rewards: torch.Tensor, mask: torch.Tensor, group_ids: Any, values: Any
) -> tuple:
    if group_ids is None:
        raise ValueError("adv_estimator 'grpo': needs group ids (the prompt uid of each response)")
    return grpo_advantages(rewards, mask, group_ids, config.norm_adv_by_std_in_grpo)


def _reinforce(
    config: RLVRConfig, rewards: torch.Tensor, mask: torch.Tensor, group_ids: Any, values: Any
) -> tuple:
    return reinforce_advantages(rewards, mask, config.gamma)


def _reinforce_pp(
    config: RLVRConfig, rewards: torch.Tensor, mask: torch.Tensor, group_ids: Any, values: Any
) -> tuple:
    return reinforce_plus_plus_advantages(rewards, mask, config.gamma)


def _gae(config: RLVRConfig, rewards: torch.Tensor, mask: torch.Tensor, group_ids: Any, values: Any) -> tuple:
    if values is None:
        raise ValueError("adv_estimator 'gae': needs values [B, R] from the critic role (configure `critic`)")
    return gae_advantages(rewards, values, mask, config.gamma, config.lambd)


ADV_ESTIMATORS: dict[str, Estimator] = {
    "grpo": _grpo,
    "reinforce": _reinforce,
    "reinforce_plus_plus": _reinforce_pp,
    "gae": _gae,
}


def clip_advantages(advantages: torch.Tensor, advantage_clip: float | None) -> torch.Tensor:
    """Advantages clamped to ``[-advantage_clip, advantage_clip]`` (unchanged when None)."""
    if advantage_clip is None:
        return advantages
    if advantage_clip <= 0:
        raise ValueError(f"advantage_clip: must be > 0, got {advantage_clip}")
    return advantages.clamp(min=-advantage_clip, max=advantage_clip)


def compute_advantages(
    config: RLVRConfig,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds | None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[B, R]`` by ``config.adv_estimator``, then whitened over the
    valid tokens (``whiten_advantages``), then clipped (``advantage_clip``); 0 on padding."""
    if config.adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"adv_estimator: expected one of {list(ADV_ESTIMATORS)}, got {config.adv_estimator!r}"
        )
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have the same shape"
        )
    estimator = ADV_ESTIMATORS[config.adv_estimator]
    advantages, returns = estimator(config, token_level_rewards, response_mask, group_ids, values)
    mask = response_mask.to(advantages.dtype)
    if config.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return clip_advantages(advantages, config.advantage_clip) * mask, returns
