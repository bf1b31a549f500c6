"""Learning-rate schedules from ``TrainingArgs`` (shared by fsdp2_train and megatron_train).

>>> scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, build_lr_lambda(args, total_steps=300))

The lambda maps the number of optimizer steps already taken (0 for the first step) to a factor of
``learning_rate``:

- warmup: ``warmup_steps`` if > 0, else ``ceil(warmup_ratio * total_steps)``; step s < warmup
  uses (s + 1) / warmup, so the first step already trains and step warmup - 1 reaches the peak;
- then "constant" stays at 1; "linear" and "cosine" decay from 1 to ``min_lr_ratio`` at
  ``total_steps`` and stay there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from roll.configs.pipeline_config import RLVRConfig
    from roll.configs.role import TrainingArgs


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return 1.0 - progress


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


DECAYS: dict[str, Callable[[float], float]] = {"constant": _constant, "linear": _linear, "cosine": _cosine}


def warmup_steps(args: TrainingArgs, total_steps: int | None) -> int:
    if args.warmup_steps > 0:
        return args.warmup_steps
    if args.warmup_ratio > 0:
        if not total_steps:
            raise ValueError("training_args.warmup_ratio needs the total number of optimizer steps")
        return math.ceil(args.warmup_ratio * total_steps)
    return 0


def build_lr_lambda(args: TrainingArgs, total_steps: int | None) -> Callable[[int], float]:
    """The LR factor for step s (see the module docstring). ``total_steps`` may be None only for
    "constant" without ``warmup_ratio``."""
    if args.lr_scheduler_type not in DECAYS:
        raise ValueError(
            f"training_args.lr_scheduler_type: expected one of {list(DECAYS)}, got {args.lr_scheduler_type!r}"
        )
    if args.lr_scheduler_type != "constant" and not total_steps:
        raise ValueError(
            f"training_args.lr_scheduler_type {args.lr_scheduler_type!r} needs the total number of optimizer steps"
        )
    decay = DECAYS[args.lr_scheduler_type]
    warmup = warmup_steps(args, total_steps)
    floor = args.min_lr_ratio
    decay_steps = max(1, (total_steps or 0) - warmup)

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / decay_steps)
        return floor + (1.0 - floor) * decay(progress)

    return lr_lambda


def optimizer_steps_per_pipeline_step(pipeline: RLVRConfig, args: TrainingArgs, dp_size: int) -> int:
    """How many optimizer steps one RLVR step takes: ppo_epochs x mini-batches, where a mini-batch
    is per_device_train_batch_size x gradient_accumulation_steps x dp_size samples of the
    rollout_batch_size x num_return_sequences_in_group samples of a step."""
    samples = pipeline.rollout_batch_size * pipeline.num_return_sequences_in_group
    mini_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp_size
    return pipeline.ppo_epochs * max(1, samples // mini_batch)


def total_optimizer_steps(pipeline: RLVRConfig | None, args: TrainingArgs, dp_size: int) -> int | None:
    """max_steps x optimizer steps per RLVR step; None without a pipeline config."""
    if pipeline is None:
        return None
    return pipeline.max_steps * optimizer_steps_per_pipeline_step(pipeline, args, dp_size)
