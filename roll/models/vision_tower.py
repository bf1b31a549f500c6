"""The vision tower of a vision-language model run alike on every rank, whatever each rank's rows hold.

Sharded training runs collectives inside the tower: FSDP2 gathers each vision block's parameters
when it runs and reduce-scatters their gradients after its backward; Megatron's DDP with
``overlap_grad_reduce`` all-reduces a bucket once each of its parameters has a gradient. A rank whose
micro-batch is text-only (RLVR data mixes text and image rows) would skip those and leave the other
ranks waiting (NCCL hangs, gloo aborts on mismatched sizes). So a forward that would run the tower
fewer times than another rank's runs it on a minimal dummy image (one merged patch, ``merge_size**2``
patches) for each missing call, multiplies the outputs by zero and adds that to the word
embeddings: the collectives match, every value and gradient stays what it was (x + 0 is x; the
tower's gradient from this rank is exactly 0, which is what its rows contribute), and the cost is
one tiny tower forward/backward.

How many times a forward runs the tower: once for the images of its rows and once for their videos
(transformers' Qwen2.5-VL / Qwen3-VL / Qwen3.5 call ``visual`` once per kind, before the decoder).
The ranks agree on the most per micro-batch with one all-reduce per step (``agreed_tower_calls``).

>>> calls = agreed_tower_calls(micro_batches, group)             # [per micro-batch], same on all ranks
>>> for micro, agreed in zip(micro_batches, calls):
...     with idle_tower_calls(model, agreed - tower_calls(micro)):
...         out = forward(micro)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from roll.models.microbatch import all_reduce_values
from roll.models.vision import MULTI_MODAL_INPUTS

# The forward inputs each of which makes the model run the tower once (images, videos).
TOWER_INPUTS = ("pixel_values", "pixel_values_videos")


def tower_calls(batch: Any) -> int:
    """How many times the model's forward over ``batch`` runs the vision tower: once if a row has
    images, once more if a row has videos."""
    if MULTI_MODAL_INPUTS not in batch:
        return 0
    rows = [r for r in batch[MULTI_MODAL_INPUTS] if r]
    return sum(any(r.get(key) is not None for r in rows) for key in TOWER_INPUTS)


def agreed_tower_calls(batches: Sequence[Any], group: Any = None) -> list[int]:
    """Per micro-batch, the most tower runs any rank of ``group`` makes in it. Every rank must hold
    the same number of micro-batches (each forward gathers parameters): a ValueError on every rank
    otherwise, rather than a collective that never completes."""
    count = len(batches)
    most, fewest = all_reduce_values([float(count), -float(count)], dist.ReduceOp.MAX, group)
    if most != -fewest:
        raise ValueError(
            f"the ranks hold {int(-fewest)} to {int(most)} micro-batches; a sharded vision-language "
            "model needs the same number on every rank"
        )
    calls = all_reduce_values([float(tower_calls(b)) for b in batches], dist.ReduceOp.MAX, group)
    return [int(c) for c in calls]


def find_tower(model: nn.Module) -> nn.Module | None:
    """The model's vision tower (the outermost module named ``visual``, transformers' name for it),
    None for a text model."""
    return next((m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "visual"), None)


def dummy_image(tower: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(``pixel_values``, ``grid_thw``) of the smallest image the tower takes: one merged patch
    (``merge_size**2`` patches of zeros)."""
    config = tower.config
    merge = int(config.spatial_merge_size)
    width = (
        int(getattr(config, "in_channels", 3)) * int(config.temporal_patch_size) * int(config.patch_size) ** 2
    )
    pixels = torch.zeros(merge * merge, width, device=device)
    return pixels, torch.tensor([[1, merge, merge]], device=device)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a model output (dict-like, tuple, list) at any depth."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def idle_tower_output(tower: nn.Module, device: torch.device) -> torch.Tensor:
    """A scalar 0 that depends on every output of the tower run on ``dummy_image``: added to the
    model's activations it changes no value, and its backward gives the tower's parameters zero
    gradients (they exist, so hooks and reductions that wait for them run)."""
    pixels, grid = dummy_image(tower, device)
    total = sum(t.float().sum() for t in _tensors(tower(pixels, grid_thw=grid)))
    return total * 0.0


def tower_wants_grads(tower: nn.Module) -> bool:
    """Whether a forward now would give ``tower`` gradients: grad mode on and a trainable parameter
    (a training forward with the tower not frozen), so a text-only forward must run it idle."""
    return torch.is_grad_enabled() and any(p.requires_grad for p in tower.parameters())


def _word_embeddings(model: nn.Module) -> nn.Module:
    """The embedding module of the model (or of a value model's backbone)."""
    return next(m for m in model.modules() if hasattr(m, "get_input_embeddings")).get_input_embeddings()


@contextlib.contextmanager
def idle_tower_calls(model: nn.Module, count: int) -> Iterator[None]:
    """Inside the block, the model's next forward runs its vision tower ``count`` more times on a
    dummy image, as its word embeddings are computed (before any decoder layer, where transformers
    runs it for real), adding 0 to them. Nothing happens for ``count`` <= 0 or a text model."""
    tower = find_tower(model) if count > 0 else None
    if tower is None:
        yield
        return
    pending = [count]

    def add_zero(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        if not pending[0]:  # the embeddings may be looked up again (placeholder masks): once only
            return output
        zero = sum(idle_tower_output(tower, output.device) for _ in range(pending[0]))
        pending[0] = 0
        return output + zero.to(output.dtype)

    handle = _word_embeddings(model).register_forward_hook(add_zero)
    try:
        yield
    finally:
        handle.remove()
