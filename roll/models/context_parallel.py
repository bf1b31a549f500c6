"""Context parallelism over packed rows in plain torch: load-balanced (zig-zag) split, K/V all-gather.

Every sequence of a packed row (``roll.models.packing``, its length padded to a multiple of
``2 x CP``) is cut into ``2 x CP`` equal chunks; CP rank ``r`` holds chunks ``r`` and
``2 CP - 1 - r`` of every sequence, so under causal attention every rank does the same work (an
early chunk with few keys, a late one with many). This is the layout megatron-core's ``thd`` RoPE
expects (``_get_thd_freqs_on_this_cp_rank``), so the model sees the local tokens and the GLOBAL
``cu_seqlens``.

Attention: each rank all-gathers K and V of the CP group (backward: the gradients of every rank's
use, summed over the group, this rank's slice kept), puts them back in global order, and runs each
local query chunk against its sequence's keys up to that chunk's end (causal, lower-right aligned).

>>> local = zigzag_indices(cu_seqlens, cp_size=2, cp_rank=rank)      # [T / CP] packed columns
>>> out = cp_packed_attention(q, k, v, cu_seqlens, scale, group)     # q/k/v: this rank's tokens
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def zigzag_indices(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Packed-row columns held by ``cp_rank``: chunks ``r`` and ``2 CP - 1 - r`` of each sequence."""
    parts = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        chunk = (end - start) // (2 * cp_size)
        if chunk * 2 * cp_size != end - start:
            raise ValueError(
                f"sequence of {end - start} tokens does not split into 2 x CP = {2 * cp_size} chunks"
            )
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    return torch.cat(parts)


class _GatherAlongFirstDim(torch.autograd.Function):
    """All-gather over ``group`` (rank order); backward sums every rank's gradient, keeps the slice."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter; same result
        size = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * size : (rank + 1) * size], None


class _SumKeepGrad(torch.autograd.Function):
    """All-reduce sum over ``group``; backward passes the gradient through (each rank backpropagates
    the same loss of the sum into its own summand)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        out = local.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_ranks(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of every CP rank's ``local`` (its own entries, zeros elsewhere), on every rank."""
    return _SumKeepGrad.apply(local, group)


@lru_cache(maxsize=64)
def global_order(bounds: tuple[int, ...], cp_size: int) -> torch.Tensor:
    """For the all-gathered (rank-major) tokens, the index that puts them in packed-row order
    (cached: every layer of a micro-batch asks for the same one)."""
    cu = torch.tensor(bounds)
    return torch.argsort(torch.cat([zigzag_indices(cu, cp_size, r) for r in range(cp_size)]))


def cp_packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    group: Any,
) -> torch.Tensor:
    """Per-sequence causal attention of this rank's zig-zag tokens ``[t, heads, d]`` against the
    whole sequences' K/V (``cu_seqlens`` global); returns ``[t, heads, d]`` in local order."""
    from torch.nn.attention.bias import causal_lower_right

    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    cu = cu_seqlens.cpu()
    order = global_order(tuple(cu.tolist()), cp_size).to(key.device)
    keys = _GatherAlongFirstDim.apply(key, group)[order]
    values = _GatherAlongFirstDim.apply(value, group)[order]
    gqa = query.shape[1] != key.shape[1]
    outs, offset = [], 0
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        chunk = (end - start) // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            q = query[offset : offset + chunk]
            offset += chunk
            stop = start + (index + 1) * chunk
            k, v = keys[start:stop], values[start:stop]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=causal_lower_right(chunk, stop - start),
                scale=scale,
                enable_gqa=gqa,
            )
            outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs)
