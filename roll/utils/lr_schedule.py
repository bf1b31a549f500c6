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


def total_optimizer_steps(run: RLVRConfig, args: TrainingArgs, dp_size: int) -> int:
    """The LR schedule length of a training role: max_steps x ppo_epochs x mini-batches per step,
    where a mini-batch is per_device_train_batch_size x gradient_accumulation_steps x dp_size of the
    rollout_batch_size x num_return_sequences_in_group samples of a step (at least one). The driver
    computes it once per role and hands it to the workers (``WorkerContext.total_optimizer_steps``).

    >>> total_optimizer_steps(config, config.actor_train.training_args, dp_size=2)
    """
    samples = run.rollout_batch_size * run.num_return_sequences_in_group
    mini_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp_size
    return run.max_steps * run.ppo_epochs * max(1, samples // mini_batch)
