"""The loss function a training strategy calls per micro-batch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll.core.batch import Batch

# loss_fn(outputs, micro_batch) -> (scalar loss, metrics). ``outputs`` holds "log_probs" and
# "entropy" ([b, R]) for policy models, or "values" ([b, R]) for value models.
LossFn = Callable[[dict[str, torch.Tensor], Batch], "tuple[torch.Tensor, dict[str, float]]"]
