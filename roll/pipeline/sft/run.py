"""``SFTRun``: what one SFT run holds (config, the actor_train cluster, data, sampler, tracker).

``build_sft_run`` turns a validated config into a live run; ``shutdown_sft_run`` releases it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roll.configs.sft_config import SFTPipelineConfig
from roll.distributed.scheduler.placement import PlacementPlan, plan_placement
from roll.pipeline.sft.chat_data import ChatExample, load_chat_files

if TYPE_CHECKING:
    from roll.pipeline.workers.model_worker import ModelCluster

logger = logging.getLogger("roll")


class EpochSampler:
    """Batches of row indices: epochs of ``randperm`` from a generator seeded with ``seed``, a batch
    taking the rest of one epoch and the start of the next. Its state is the number of batches
    drawn (a resume replays them, so the position and generator match exactly)."""

    def __init__(self, num_rows: int, batch_size: int, seed: int) -> None:
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self._reset()

    def _reset(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)
        self.order: list[int] = []
        self.drawn = 0

    def take(self) -> list[int]:
        while len(self.order) < self.batch_size:
            self.order += torch.randperm(self.num_rows, generator=self.generator).tolist()
        picked, self.order = self.order[: self.batch_size], self.order[self.batch_size :]
        self.drawn += 1
        return picked

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn, "num_rows": self.num_rows, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._reset()
        for _ in range(state["drawn"]):
            self.take()


@dataclass
class SFTRun:
    config: SFTPipelineConfig
    plan: PlacementPlan
    run_dir: Path
    tokenizer: Any
    train: list[ChatExample]
    val: list[ChatExample]
    sampler: EpochSampler
    trainer: ModelCluster | None = None  # the actor_train cluster
    resources: Any = None
    tracker: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def global_batch_size(config: SFTPipelineConfig, plan: PlacementPlan) -> int:
    args = config.actor_train.training_args
    dp = plan.roles["actor_train"].parallel.dp
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * dp


def build_sft_run(config: SFTPipelineConfig) -> SFTRun:
    from roll.distributed.scheduler.resource_manager import ResourceManager
    from roll.models.tokenizer import load_tokenizer
    from roll.pipeline.workers.model_worker import ModelCluster, ModelWorker

    plan = plan_placement(config)
    tokenizer = load_tokenizer(config.actor_train.model_args.model_name_or_path)
    data = config.data
    keys = (data.messages_key, data.response_key)
    train = load_chat_files(data.train_files, tokenizer, data.max_length, "data.train_files", *keys)
    val = (
        load_chat_files(data.val_files, tokenizer, data.max_length, "data.val_files", *keys)
        if data.val_files
        else []
    )
    batch = global_batch_size(config, plan)
    logger.info("sft: %d train / %d val conversations, %d per step", len(train), len(val), batch)
    run = SFTRun(
        config,
        plan,
        Path(config.output_dir),
        tokenizer,
        train,
        val,
        EpochSampler(len(train), batch, config.seed),
    )
    run.resources = ResourceManager(plan, config.device)
    run.trainer = ModelCluster(
        "actor_train", ModelWorker, run.resources, plan.roles["actor_train"], config.actor_train, config
    )
    run.trainer.initialize(config.max_steps)  # one optimizer step per SFT step
    return run


def shutdown_sft_run(run: SFTRun | None) -> None:
    if run is None:
        return
    if run.trainer is not None:
        try:
            run.trainer.shutdown()
        except Exception as exc:  # noqa: BLE001 - best effort while tearing down
            logger.warning("shutting down actor_train: %s", exc)
    if run.resources is not None:
        run.resources.destroy()
