"""``RewardWorker``: scores responses for one reward role.

Rule rewards (``math_rule``, ``format``, ...) run on CPU with a per-sample time limit; the role's
``world_size`` workers score disjoint shards in parallel. Model rewards (``llm_judge``) run the
role's own inference strategy on its devices.

Each call returns ``scores`` [B] and, per sample, ``reward_error`` [B] (1.0: the function raised or
gave no finite number, or one beyond ``max_abs_reward``; the sample scores 0.0), ``reward_timeout``
[B], ``reward_skipped`` [B] (not scored: the call stopped early) and ``reward_error_msg`` (the
message of an error or a timeout, "" when none). The pipeline counts errors and timeouts as
failures against ``max_error_fraction``; a rule reward stops scoring once its share of the call
(``batch.meta["reward_samples"]``: the samples of the role's whole call, over every worker) has
failed on more than that fraction allows.
``RewardCluster`` is the driver's handle on one reward role's workers.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from roll.core.batch import Batch
from roll.distributed.executor.dispatch import Dispatch, register
from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.cluster import Cluster
from roll.pipeline.rewards.registry import get_reward_spec, load_reward_fn


class RewardWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def initialize(self) -> dict[str, Any]:
        """Load the reward model or build the rule scorer; returns the seconds it took with this
        worker's start-up marks (``roll.utils.start_marks``)."""
        self.start_marks.mark("initialize")
        start = time.perf_counter()
        self.spec = get_reward_spec(self.role_config.reward_fn)
        if self.spec.kind == "model":
            self.create_strategy()
            self.strategy.initialize()
        else:
            from roll.pipeline.rewards.scoring import RewardScorer

            cfg = self.role_config
            self.scorer = RewardScorer(
                cfg.reward_fn, cfg.reward_kwargs, cfg.timeout_s, max_abs_reward=cfg.max_abs_reward
            )
        self.start_marks.mark("initialized")
        return self.start_marks.report(time.perf_counter() - start)

    @register(Dispatch.DP_COMPUTE)
    def compute_rewards(self, batch: Batch) -> Batch:
        """``scores`` [B] for ``batch["response_text"]`` against ``batch["ground_truth"]``, with
        the per-sample error fields of the module docstring."""
        from roll.pipeline.rewards.scoring import ScoreResult, allowed_failures, checked_score

        cfg = self.role_config
        n = len(batch)
        if self.spec.kind == "model":
            raw = [float(s) for s in load_reward_fn(cfg.reward_fn)(self.strategy, batch, cfg)]
            result = ScoreResult(raw, [""] * n, [False] * n, [False] * n)
            for i, value in enumerate(raw):
                try:
                    checked_score(value, cfg.max_abs_reward)
                except ValueError as exc:
                    result.scores[i], result.errors[i] = 0.0, f"ValueError: {exc}"
        else:
            total = int(batch.meta.get("reward_samples", n))
            result = self.scorer.score_detailed(
                [str(r) for r in batch["response_text"]],
                [str(g) for g in batch["ground_truth"]],
                max_failures=allowed_failures(cfg.max_error_fraction, total),
                contexts=list(batch["reward_context"]) if "reward_context" in batch else None,
            )
        timed_out = f"TimeoutError: no score within timeout_s={cfg.timeout_s:g} s"
        messages = [
            e or (timed_out if t else "") for e, t in zip(result.errors, result.timeouts, strict=True)
        ]
        tensors = {
            "scores": torch.as_tensor(result.scores, dtype=torch.float32),
            "reward_error": torch.as_tensor([float(bool(e)) for e in result.errors]),
            "reward_timeout": torch.as_tensor([float(t) for t in result.timeouts]),
            "reward_skipped": torch.as_tensor([float(s) for s in result.skipped]),
        }
        return Batch.from_dict(tensors, {"reward_error_msg": messages})

    @register(Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:
        if getattr(self, "scorer", None) is not None:
            self.scorer.close()
        super().shutdown()


class RewardCluster(Cluster):
    """The driver's handle on the ``RewardWorker``s of one reward role."""

    worker_base = RewardWorker

    def initialize(self) -> None:
        self.call(RewardWorker.initialize)
        self.refresh_dp_layout()

    def compute_rewards(self, batch: Batch) -> Batch:
        return self.call(RewardWorker.compute_rewards, batch)
