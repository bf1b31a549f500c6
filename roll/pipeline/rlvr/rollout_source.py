"""Where the step loop gets each step's scored rollouts: generated now, or one step ahead.

    rollouts = RolloutSource(run)
    batch, metrics = rollouts.take(step, timer)   # async: starts generating step + 1 before returning
    ...train on batch...
    rollouts.settle()                              # the engines finish step + 1 before their weights change
    update_inference_weights(run, step)

``async_generation_ratio: 0`` (synchronous): ``take`` generates step k with the weights of step k - 1.
``1`` (disaggregated actor_infer only, checked before launch): a background thread generates step
k + 1 while the driver trains on step k, with the weights of step k - 1, so every sample is at most
one version stale (``rollout/staleness``); ``weight_version`` on every row and the off-policy
correction (``old_log_probs`` come from the trainer's current weights) account for it. Generation
and reward times of a background step appear as ``time/generate`` and ``time/reward`` but not in
``time/step``, which becomes the driver's wall time (blocked waits are ``time/wait_rollouts``).

A checkpoint saved while step k + 1 is in flight records the sampler position before its prompts,
so a resume draws the same prompts (generated then with the newer weights).

``rollout_dump.mode: dump`` writes each step's rollouts and sampling metrics once collected;
``replay`` reads them instead (timed as ``time/replay``): no prompt is drawn, actor_infer generates
nothing and no reward role scores (roll/pipeline/rlvr/rollout_dump.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.pipeline.common.timing import StageTimer
from roll.pipeline.rlvr.rollout_dump import RolloutDump
from roll.pipeline.rlvr.rollouts import collect_rollouts
from roll.pipeline.rlvr.run import RLVRRun


class RolloutSource:
    def __init__(self, run: RLVRRun) -> None:
        self.run = run
        self.ahead = bool(run.config.async_generation_ratio)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts") if self.ahead else None
        self.pending: dict[int, Future] = {}
        self.sampler_before: dict[int, Any] = {}
        self.dump = RolloutDump.open(run.config, run.tokenizer) if run.config.rollout_dump.enabled else None

    def params(self, step: int) -> SamplingParams:
        args = self.run.config.actor_infer.generating_args
        return args.sampling_params(seed=self.run.config.seed + step)

    def take(self, step: int, timer: StageTimer) -> tuple[Batch, dict[str, float]]:
        """Step ``step``'s rollouts and sampling metrics (see the module doc)."""
        if not self.ahead:
            return self.collect(step, timer)
        future = self.pending.get(step) or self._submit(step)
        with timer("wait_rollouts"):
            batch, metrics, times = future.result()
        del self.pending[step], self.sampler_before[step]
        timer.background.update(times)
        if step < self.run.config.max_steps:
            self._submit(step + 1)
        return batch, metrics

    def collect(self, step: int, timer: StageTimer) -> tuple[Batch, dict[str, float]]:
        """Step ``step``'s rollouts, generated now (and dumped) or read from the dump."""
        if self.dump is not None and self.dump.mode == "replay":
            with timer("replay"):
                return self.dump.read(step)
        batch, metrics = collect_rollouts(self.run, step, self.params(step), timer)
        if self.dump is not None:
            with timer("dump"):
                self.dump.write(step, batch, metrics)
        return batch, metrics

    def settle(self) -> None:
        """Wait for the generation in flight (its engine's weights are about to change)."""
        for future in self.pending.values():
            future.exception()

    def sampler_state(self) -> Any:
        """The sampler position a checkpoint should save: before the prompts of a step in flight."""
        return min(self.sampler_before.items())[1] if self.sampler_before else self.run.sampler.state_dict()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, step: int) -> Future:
        self.sampler_before[step] = self.run.sampler.state_dict()

        def work() -> tuple[Batch, dict[str, float], dict[str, float]]:
            timer = StageTimer()
            batch, metrics = self.collect(step, timer)
            return batch, metrics, timer.times

        self.pending[step] = self.pool.submit(work)
        return self.pending[step]
