"""One collective for fsdp2's weight export: the full tensors of many DTensors sharded on dim 0,
gathered in a single ``all_gather`` (a per-tensor ``full_tensor()`` would issue one collective each).

>>> fulls = gather_dim0_shards(dtensors, device, mesh.get_group("shard"))
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def gather_dim0_shards(
    tensors: list[DTensor], device: torch.device, group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """The full tensors of DTensors sharded on dim 0 over ``group`` (``placements == (Shard(0),)``,
    one dtype), with one ``all_gather_into_tensor``: each rank sends its shards, each padded to
    ``ceil(rows / ranks)`` rows (torch.chunk's split, which FSDP2 and DTensor use), one after the
    other; rank r's block holds rows r*c .. r*c + c - 1 of every tensor, so each full tensor is its
    columns of the gathered blocks, stacked, less the padding."""
    ranks = dist.get_world_size(group)
    pieces, layout = [], []
    for tensor in tensors:
        rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
        chunk = -(-rows // ranks)
        local = tensor.to_local().detach().to(device)
        padded = local.new_zeros((chunk, *rest))
        padded[: local.shape[0]] = local
        pieces.append(padded.reshape(-1))
        layout.append((rows, chunk, rest))
    send = torch.cat(pieces)
    received = send.new_empty(ranks * send.numel())
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(received, send, group=group)
    blocks = received.view(ranks, -1)
    fulls, offset = [], 0
    for rows, chunk, rest in layout:
        width = chunk * math.prod(rest)
        fulls.append(blocks[:, offset : offset + width].reshape(ranks * chunk, *rest)[:rows])
        offset += width
    return fulls
