"""fsdp2's weight export: full tensors out of the sharded model's state, a group of tensors per
collective. The DTensors sharded on dim 0 over the mesh's shard axis go in a single ``all_gather``
(a per-tensor ``full_tensor()`` would issue one collective each); others (expert slices, other
layouts) are gathered on their own.

>>> for name, full in iter_full_state(model.state_dict(), mesh, device, rank, experts): ...
>>> fulls = gather_dim0_shards(dtensors, device, mesh.get_group("shard"))
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

if TYPE_CHECKING:
    from roll.distributed.strategy.fsdp2_experts import ExpertLayout

# The shards of at most this many bytes (of one dtype) are gathered in one collective.
GATHER_GROUP_BYTES = 256 << 20


def iter_full_state(
    state: dict[str, torch.Tensor],
    mesh: DeviceMesh,
    device: torch.device,
    rank: int,
    experts: ExpertLayout | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(state_dict name, full tensor in its own dtype), gathered by groups of ``GATHER_GROUP_BYTES``
    of one dtype. Collective: every rank must exhaust it; only ``rank`` 0 yields."""
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if group and (size + nbytes > GATHER_GROUP_BYTES or tensor.dtype != group[0][1].dtype):
            yield from _yield_full(group, mesh, device, rank, experts)
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield from _yield_full(group, mesh, device, rank, experts)


def _yield_full(
    group: list[tuple[str, torch.Tensor]],
    mesh: DeviceMesh,
    device: torch.device,
    rank: int,
    experts: ExpertLayout | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    fulls = _full_tensors([tensor for _, tensor in group], mesh, device, experts)
    if rank == 0:
        yield from zip([name for name, _ in group], fulls)


def _full_tensors(
    tensors: list[torch.Tensor], mesh: DeviceMesh, device: torch.device, experts: ExpertLayout | None
) -> list[torch.Tensor]:
    """Full copies of ``tensors`` on every rank: the dim-0 shards of the mesh's shard axis (the
    replicate axis, when there is one, holds copies) in one all-gather over that axis, any other
    tensor on its own (``_full_tensor``)."""
    fulls: list[torch.Tensor | None] = [None] * len(tensors)
    sharded = [i for i, t in enumerate(tensors) if _dim0_sharded(t, mesh)]
    if sharded:
        gathered = gather_dim0_shards([tensors[i] for i in sharded], device, mesh.get_group("shard"))
        for i, full in zip(sharded, gathered):
            fulls[i] = full
    return [full if full is not None else _full_tensor(t, device, experts) for full, t in zip(fulls, tensors)]


def _dim0_sharded(tensor: torch.Tensor, mesh: DeviceMesh) -> bool:
    """FSDP2's layout on this mesh: Shard(0) on the shard axis, Replicate on the replicate one."""
    layout = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    return isinstance(tensor, DTensor) and tensor.device_mesh == mesh and tuple(tensor.placements) == layout


def _full_tensor(tensor: torch.Tensor, device: torch.device, experts: ExpertLayout | None) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return tensor.detach()
    if experts is not None and experts.is_expert(tensor):
        return experts.full_tensor(tensor)
    local = tensor.to_local()
    if local.device != device:  # cpu_offload keeps shards on CPU; gather on the compute device
        tensor = DTensor.from_local(
            local.to(device),
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return tensor.full_tensor().detach()


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
