"""``RewardWorker``: scores responses for one reward role.

Rule rewards (``math_rule``, ``format``, ...) run on CPU with a per-sample time limit; the role's
``world_size`` workers score disjoint shards in parallel. Model rewards (``llm_judge``) run the
role's own inference strategy on its devices.
"""

from __future__ import annotations

import torch

from roll.distributed.executor.dispatch import Dispatch, register
from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.batch import Batch
from roll.pipeline.rlvr.rewards.registry import get_reward_spec, load_reward_fn


class RewardWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def initialize(self) -> None:
        self.spec = get_reward_spec(self.role_config.reward_fn)
        if self.spec.kind == "model":
            self.create_strategy()
            self.strategy.initialize()
        else:
            from roll.pipeline.rlvr.rewards.scoring import RewardScorer

            cfg = self.role_config
            self.scorer = RewardScorer(cfg.reward_fn, cfg.reward_kwargs, cfg.timeout_s)

    @register(Dispatch.DP_COMPUTE)
    def compute_rewards(self, batch: Batch) -> Batch:
        """Field ``scores`` [B] for ``batch["response_text"]`` against ``batch["ground_truth"]``."""
        cfg = self.role_config
        if self.spec.kind == "model":
            scores = load_reward_fn(cfg.reward_fn)(self.strategy, batch, cfg)
        else:
            scores = self.scorer.score(
                [str(r) for r in batch["response_text"]], [str(g) for g in batch["ground_truth"]]
            )
        return Batch.from_dict({"scores": torch.as_tensor(scores, dtype=torch.float32)})

    @register(Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:
        if getattr(self, "scorer", None) is not None:
            self.scorer.close()
        super().shutdown()
