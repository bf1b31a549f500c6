"""Where a strategy runs: its role, its rank in the role's process group, and its device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class WorkerContext:
    role: str
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    seed: int = 42
    # The whole run's config (prompt_length, response_length, ...); None in unit tests.
    pipeline: Any = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"
