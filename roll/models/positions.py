"""Position ids: the one place roll computes them, from an attention mask or from packed segments.

A Batch row is LEFT-padded prompt then RIGHT-padded response (``roll.distributed.strategy.base``),
so its real tokens are one contiguous run and RoPE must count them from 0 where the run starts:

>>> make_position_ids(torch.tensor([[0, 0, 1, 1, 1, 0]]))
tensor([[0, 0, 0, 1, 2, 2]])

A packed row (``roll.models.packing``) holds many runs, one per segment of ``cu_seqlens``;
positions restart at 0 in each segment:

>>> packed_positions(torch.tensor([0, 2, 5, 6]), 6)
tensor([0, 1, 0, 1, 2, 0])
"""

from __future__ import annotations

import torch


def make_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """cumsum(attention_mask) - 1, clamped at 0: left padding gets 0, real tokens count from 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] position of each token inside its segment (segment k spans ``cu_seqlens[k:k+2]``;
    empty segments are allowed). No host sync: megatron's thd RoPE calls it inside every layer."""
    cu = cu_seqlens.to(torch.long)
    index = torch.arange(total, device=cu.device)
    segment = torch.searchsorted(cu[1:], index, right=True)
    return index - cu[segment]


def cu_seqlens_from(lengths: torch.Tensor) -> torch.Tensor:
    """[len(lengths) + 1] ``cu_seqlens`` of segments of ``lengths`` laid end to end: 0, then each end."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
