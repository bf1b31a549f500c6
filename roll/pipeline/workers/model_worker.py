"""``ModelWorker``: the Ray actor of every model role (actor_train, actor_infer, reference, critic).

It owns one strategy (chosen by ``strategy_args.strategy_name``) and adds the RL-specific loops
around it: PPO epochs over mini-batches of its data-parallel shard, per-step generation seeds, and
checkpoints that include the worker's RNG state. A critic is the same worker with a value model
(``compute_values`` instead of ``compute_log_probs``).

``ModelCluster`` is the driver's handle on a role of them, one typed method per worker call::

    cluster = ModelCluster("actor_train", ModelWorker, resource_manager, role_plan, role_config, config)
    cluster.initialize()
    metrics = cluster.train_step(batch, make_actor_loss_fn(config), seed)   # one dict per DP rank
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from roll.core.batch import Batch
from roll.core.loss import ROW_INDEX, LogProbRecorder, LossFn
from roll.core.sampling import SamplingParams
from roll.distributed.executor.dispatch import Dispatch, register
from roll.distributed.executor.worker import Worker
from roll.distributed.model_update.worker_mixin import ModelUpdateReceiverMixin, ModelUpdateSenderMixin
from roll.distributed.scheduler.cluster import Cluster
from roll.utils.rng import rng_state, seed_everything, set_rng_state


@dataclasses.dataclass
class TrainStepResult:
    """What ``ModelWorker.train_step`` returns from a rank: its metrics (the mean over its optimizer
    steps) and, with ``record_log_probs``, the rows' ``row_index``, ``log_probs`` and ``entropy`` of
    the training forward."""

    metrics: dict[str, float]
    log_probs: Batch | None = None


class ModelWorker(ModelUpdateSenderMixin, ModelUpdateReceiverMixin, Worker):
    @register(Dispatch.ONE_TO_ALL)
    def initialize(self, total_optimizer_steps: int | None = None) -> dict[str, Any]:
        """Build and start the strategy; a training role gets its LR schedule length from the
        driver (``roll.utils.lr_schedule.total_optimizer_steps``). Returns the seconds it took
        (the start-up's per-role ``initialize`` phase) with this worker's start-up marks
        (``roll.utils.start_marks``)."""
        self.start_marks.mark("initialize")
        start = time.perf_counter()
        self.ctx.total_optimizer_steps = total_optimizer_steps
        self.create_strategy()
        self.strategy.initialize()
        self.start_marks.mark("initialized")
        return self.start_marks.report(time.perf_counter() - start)

    @register(Dispatch.DP_COMPUTE)
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        if params.seed is not None:
            # Same seed on every rank of a DP group (TP peers must sample alike), distinct across
            # groups. Strategies with their own sampling stream (hf_infer, vllm, sglang) read it from
            # params; the global seed serves those that sample from torch's RNG (megatron_infer).
            params = dataclasses.replace(params, seed=params.seed + 1000 * self.dp_layout()[0])
            seed_everything(params.seed)
        return self.strategy.generate(batch, params)

    @register(Dispatch.DP_COMPUTE)
    def compute_log_probs(self, batch: Batch, output_key: str = "old_log_probs") -> Batch:
        """Log-probs of ``batch["responses"]`` under this role's model, as field ``output_key``
        (with ``entropy`` when the field is ``old_log_probs``)."""
        out = self.strategy.compute_log_probs(batch)
        fields = {output_key: out["log_probs"].cpu()}
        if "entropy" in out and output_key == "old_log_probs":
            fields["entropy"] = out["entropy"].cpu()
        return Batch.from_dict(fields)

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        """The value model's ``values`` [B, R] for ``batch["responses"]`` (the critic)."""
        return Batch.from_dict({"values": self.strategy.compute_values(batch).cpu()})

    @register(Dispatch.DP_COMPUTE)
    def train_step(
        self, batch: Batch, loss_fn: LossFn, seed: int, ppo_epochs: int = 1, record_log_probs: bool = False
    ) -> TrainStepResult:
        """``ppo_epochs`` passes over this rank's shard, one optimizer step per mini-batch of
        per_device_train_batch_size x gradient_accumulation_steps rows, shuffled per epoch.

        ``record_log_probs``: the step must be one optimizer step (one epoch, the shard one
        mini-batch), so every micro-batch's forward runs before the update; the ``log_probs`` and
        ``entropy`` it computed come back in ``TrainStepResult.log_probs`` by ``row_index`` (a token
        budget may move rows between ranks): the old log-probs, without a pass of their own."""
        args = self.role_config.training_args
        mini = args.per_device_train_batch_size * args.gradient_accumulation_steps
        recorder = None
        if record_log_probs:
            if ppo_epochs != 1 or len(batch) > mini:
                raise ValueError(
                    f"{self.role}: record_log_probs needs one optimizer step, but {ppo_epochs} epoch(s) of "
                    f"{len(batch)} rows per rank make {ppo_epochs * -(-len(batch) // mini)} of {mini} rows"
                )
            loss_fn = recorder = LogProbRecorder(loss_fn)
        generator = torch.Generator().manual_seed(seed)
        collected: dict[str, list[float]] = defaultdict(list)
        for _ in range(ppo_epochs):
            shuffled = batch.index(torch.randperm(len(batch), generator=generator))
            for mini_batch in shuffled.split(mini):
                micro_batches = mini_batch.split(args.per_device_train_batch_size)
                for key, value in self.strategy.train_step(micro_batches, loss_fn).items():
                    collected[key].append(float(value))
        metrics = {key: float(np.mean(values)) for key, values in collected.items()}
        return TrainStepResult(metrics, recorder.batch() if recorder is not None else None)

    @register(Dispatch.ONE_TO_ALL)
    def offload_states(self) -> None:
        self.strategy.offload_states()

    @register(Dispatch.ONE_TO_ALL)
    def reload_states(self) -> None:
        self.strategy.reload_states()

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        target = Path(path) / self.role
        target.mkdir(parents=True, exist_ok=True)
        self.strategy.save_checkpoint(str(target))
        (target / f"rng_rank{self.rank}.json").write_text(json.dumps(rng_state()))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        target = Path(path) / self.role
        self.strategy.load_checkpoint(str(target))
        set_rng_state(json.loads((target / f"rng_rank{self.rank}.json").read_text()))

    @register(Dispatch.ONE_TO_ALL)
    def save_hf_checkpoint(self, path: str) -> None:
        self.strategy.save_hf_checkpoint(path)


class ModelCluster(Cluster):
    """The driver's handle on the ``ModelWorker``s of one model role (see the module docstring).

    DP_COMPUTE methods take a batch whose rows split evenly over the DP ranks
    (``roll.pipeline.rlvr.stages.dp_call`` pads one that does not)."""

    worker_base = ModelWorker

    def initialize(self, total_optimizer_steps: int | None = None) -> None:
        """Build every rank's strategy, then re-read the DP layout the strategies define."""
        self.call(ModelWorker.initialize, total_optimizer_steps)
        self.refresh_dp_layout()

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        return self.call(ModelWorker.generate, batch, params)

    def compute_log_probs(self, batch: Batch, output_key: str = "old_log_probs") -> Batch:
        return self.call(ModelWorker.compute_log_probs, batch, output_key)

    def compute_values(self, batch: Batch) -> Batch:
        return self.call(ModelWorker.compute_values, batch)

    def train_step(
        self, batch: Batch, loss_fn: LossFn, seed: int, ppo_epochs: int = 1
    ) -> list[dict[str, float]]:
        """One metrics dict per DP rank."""
        return [r.metrics for r in self.call(ModelWorker.train_step, batch, loss_fn, seed, ppo_epochs)]

    def train_step_with_log_probs(
        self, batch: Batch, loss_fn: LossFn, seed: int
    ) -> tuple[list[dict[str, float]], Batch]:
        """One optimizer step (one epoch, one mini-batch per rank) that also returns the log-probs its
        forward computed before the update: (metrics per DP rank, ``old_log_probs`` and ``entropy``
        [B, R] in ``batch``'s row order)."""
        rows = Batch.from_dict({ROW_INDEX: torch.arange(len(batch))})
        results = self.call(ModelWorker.train_step, batch.union(rows), loss_fn, seed, 1, True)
        recorded = Batch.concat([r.log_probs for r in results])
        return [r.metrics for r in results], in_row_order(recorded, len(batch), self.role)

    def offload_states(self) -> None:
        self.call(ModelWorker.offload_states)

    def reload_states(self) -> None:
        self.call(ModelWorker.reload_states)

    def save_checkpoint(self, path: str) -> None:
        self.call(ModelWorker.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.call(ModelWorker.load_checkpoint, path)

    def save_hf_checkpoint(self, path: str) -> None:
        self.call(ModelWorker.save_hf_checkpoint, path)

    def model_update_version(self) -> list[int | None]:
        """The weight version every rank holds (see ``roll.distributed.model_update``)."""
        return self.call(ModelWorker.model_update_version)


def in_row_order(recorded: Batch, rows: int, role: str) -> Batch:
    """``old_log_probs`` and ``entropy`` [rows, R] from a ``LogProbRecorder``'s rows, which came in
    any order and from any rank; a row no rank recorded is an error."""
    index = recorded[ROW_INDEX]
    seen = torch.zeros(rows, dtype=torch.bool)
    seen[index] = True
    if not seen.all():
        missing = (~seen).nonzero().flatten().tolist()
        raise RuntimeError(f"{role}: the training forward gave no log-probs for rows {missing[:8]}")
    out = {}
    for key, name in (("log_probs", "old_log_probs"), ("entropy", "entropy")):
        if key in recorded:
            values = recorded[key]
            out[name] = values.new_zeros((rows, *values.shape[1:]))
            out[name][index] = values
    return Batch.from_dict(out)
