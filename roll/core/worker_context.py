"""Where a strategy runs (its role, its rank in the role's process group, its device) and the
values of the run it needs beyond its role's config, set by the worker from what the driver sent.

    ctx = WorkerContext("actor_train", rank=0, world_size=2, local_rank=0, device=torch.device("cpu"),
                        total_optimizer_steps=300)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WorkerContext:
    role: str
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    seed: int = 42
    # Width R of every generated batch: the run's response_length (None: each call's max_new_tokens).
    response_length: int | None = None
    # Length of a training role's LR schedule in optimizer steps, computed once on the driver
    # (roll.utils.lr_schedule.total_optimizer_steps); None: only constant schedules can run.
    total_optimizer_steps: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"
