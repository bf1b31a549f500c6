"""Reward failures seen by the driver: counted per step and per reward role, and a run that
stops once a role fails on more than ``max_error_fraction`` of a call's samples.

>>> check_reward_result("rewards.math", config.rewards["math"], result)   # raises RewardError
>>> reward_error_metrics(batch, {"math": [0, 1, 2]})
{'reward/errors': 1.0, 'reward/timeouts': 0.0, 'reward/math/errors': 1.0, 'reward/math/timeouts': 0.0}
"""

from __future__ import annotations

import torch

from roll.configs.errors import RewardError
from roll.configs.role import RewardConfig
from roll.core.batch import Batch


def check_reward_result(role: str, config: RewardConfig, result: Batch) -> None:
    """RewardError naming ``role``, its function and one example error when too many samples
    failed, or when a score is not finite (a reward that bypassed the per-sample checks)."""
    scores = result["scores"]
    bad = ~torch.isfinite(scores)
    if bad.any():
        example = scores[bad][0].item()
        raise RewardError(
            f"{role}: reward_fn {config.reward_fn!r} gave {int(bad.sum())} non-finite score(s), e.g. {example}"
        )
    if "reward_error" not in result or len(result) == 0:
        return
    failed = int(result["reward_error"].sum().item())
    if failed / len(result) > config.max_error_fraction:
        first = next(m for m in result["reward_error_msg"] if m)
        raise RewardError(
            f"{role}: reward_fn {config.reward_fn!r} failed on {failed} of {len(result)} samples "
            f"(more than max_error_fraction={config.max_error_fraction}), e.g. {first}"
        )


def reward_error_metrics(batch: Batch, routes: dict[str, list[int]]) -> dict[str, float]:
    """``reward/errors`` and ``reward/timeouts`` (sample counts in ``batch``), and the same per role."""
    if "reward_error" not in batch:
        return {}
    errors, timeouts = batch["reward_error"], batch["reward_timeout"]
    metrics = {"reward/errors": errors.sum().item(), "reward/timeouts": timeouts.sum().item()}
    for name, rows in routes.items():
        index = torch.as_tensor(rows, dtype=torch.long)
        metrics[f"reward/{name}/errors"] = errors[index].sum().item()
        metrics[f"reward/{name}/timeouts"] = timeouts[index].sum().item()
    return metrics
