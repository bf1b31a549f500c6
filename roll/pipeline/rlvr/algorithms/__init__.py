"""RL algorithms as pure torch functions: masked reductions, KL estimators, advantage estimators,
PPO-family losses with their ``LossFn`` factories, and per-step metrics."""

from roll.pipeline.rlvr.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    compute_token_level_rewards,
    token_level_rewards_from_config,
)
from roll.pipeline.rlvr.algorithms.kl import KL_ESTIMATORS, get_kl_estimator, kl_penalty
from roll.pipeline.rlvr.algorithms.losses import (
    make_actor_loss_fn,
    make_critic_loss_fn,
    policy_loss,
    value_loss,
)
from roll.pipeline.rlvr.algorithms.masked import agg_loss, masked_mean, masked_whiten
from roll.pipeline.rlvr.algorithms.metrics import (
    logprob_mismatch,
    masked_stats,
    response_length_stats,
    score_stats_by_domain,
)

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "agg_loss",
    "compute_advantages",
    "compute_token_level_rewards",
    "get_kl_estimator",
    "kl_penalty",
    "logprob_mismatch",
    "make_actor_loss_fn",
    "make_critic_loss_fn",
    "masked_mean",
    "masked_stats",
    "masked_whiten",
    "policy_loss",
    "response_length_stats",
    "score_stats_by_domain",
    "token_level_rewards_from_config",
    "value_loss",
]
