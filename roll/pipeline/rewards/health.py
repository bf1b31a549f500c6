"""Reward failures seen by the driver: counted per step and per reward role, one warning line per
scoring call that had any, and a run that stops once a role fails on more than
``max_error_fraction`` of a call's samples.

A failure is a sample whose function raised, gave no finite number or one beyond
``max_abs_reward`` (``reward_error``), or ran past ``timeout_s`` (``reward_timeout``).

>>> check_reward_result("rewards.math", config.rewards["math"], result)   # warns; raises RewardError
>>> reward_error_metrics(batch, {"math": [0, 1, 2]})
{'reward/errors': 1.0, 'reward/timeouts': 0.0, 'reward/failures': 1.0, 'reward/math/errors': 1.0, ...}
"""

from __future__ import annotations

import logging

import torch

from roll.configs.role import RewardConfig
from roll.core.batch import Batch
from roll.core.errors import RewardError
from roll.pipeline.rewards.scoring import allowed_failures

logger = logging.getLogger("roll")


def check_reward_result(role: str, config: RewardConfig, result: Batch) -> None:
    """Log one warning naming ``role``, its function and the first failure when any sample failed;
    RewardError when more than ``max_error_fraction`` of them did, or when a score is not finite or
    beyond ``max_abs_reward`` (a reward that bypassed the per-sample checks)."""
    _check_scores(role, config, result["scores"])
    if "reward_error" not in result or len(result) == 0:
        return
    errors, timeouts = int(result["reward_error"].sum().item()), int(result["reward_timeout"].sum().item())
    failed = errors + timeouts
    if not failed:
        return
    first = next((m for m in result["reward_error_msg"] if m), "(no message)")
    n = len(result)
    what = f"reward_fn {config.reward_fn!r} failed on {failed} of {n} samples"
    detail = f"{errors} error(s), {timeouts} timeout(s)"
    if failed > allowed_failures(config.max_error_fraction, n):
        skipped = int(result["reward_skipped"].sum().item()) if "reward_skipped" in result else 0
        stopped = f"; {skipped} more were not scored" if skipped else ""
        raise RewardError(
            f"{role}: {what} (more than max_error_fraction={config.max_error_fraction}{stopped}), e.g. {first}"
        )
    logger.warning("%s: %s (%s), e.g. %s", role, what, detail, first)


def _check_scores(role: str, config: RewardConfig, scores: torch.Tensor) -> None:
    bad = ~torch.isfinite(scores)
    if bad.any():
        example = scores[bad][0].item()
        raise RewardError(
            f"{role}: reward_fn {config.reward_fn!r} gave {int(bad.sum())} non-finite score(s), e.g. {example}"
        )
    huge = scores.abs() > config.max_abs_reward
    if huge.any():
        raise RewardError(
            f"{role}: reward_fn {config.reward_fn!r} gave {int(huge.sum())} score(s) beyond "
            f"max_abs_reward={config.max_abs_reward:g}, e.g. {scores[huge][0].item():g}"
        )


def reward_error_metrics(batch: Batch, routes: dict[str, list[int]]) -> dict[str, float]:
    """``reward/errors``, ``reward/timeouts`` and ``reward/failures`` (their sum: what
    ``max_error_fraction`` counts), sample counts in ``batch``, and the same per role."""
    if "reward_error" not in batch:
        return {}
    errors, timeouts = batch["reward_error"], batch["reward_timeout"]
    metrics = {
        "reward/errors": errors.sum().item(),
        "reward/timeouts": timeouts.sum().item(),
        "reward/failures": (errors + timeouts).sum().item(),
    }
    for name, rows in routes.items():
        index = torch.as_tensor(rows, dtype=torch.long)
        metrics[f"reward/{name}/errors"] = errors[index].sum().item()
        metrics[f"reward/{name}/timeouts"] = timeouts[index].sum().item()
        metrics[f"reward/{name}/failures"] = (errors[index] + timeouts[index]).sum().item()
    return metrics
