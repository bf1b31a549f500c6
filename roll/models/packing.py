"""Sequence packing for the training strategies (megatron and FSDP2 share it).

A roll Batch row holds one contiguous run of real tokens (prompt LEFT-padded, response
RIGHT-padded, see ``roll.distributed.strategy.base``). Packing concatenates the runs of a
micro-batch into ONE row of ``T`` tokens (a ``thd`` layout): position ids restart at 0 for every
sequence, ``cu_seqlens`` marks where each sequence starts (the padding after the last sequence is a
segment of its own), and attention must stay inside a segment (causal per segment). Nothing is
computed for padding between sequences, so a micro-batch costs its real token count, not
``rows x longest row``.

``window[i, t]`` is the column of the packed row whose logits score ``responses[i, t]`` (the
column right before that token); it is clamped into the row where the response is padding, and
callers zero those positions with ``response_mask``.

>>> packed = pack_rows(micro_batch, multiple=8)
>>> logits = model(packed.input_ids, position_ids=packed.position_ids)   # [1, T, V], attention per segment
>>> scoring = logits[0, packed.window]                                    # [B, R, V]

Token-budget micro-batches and loss weights are in ``roll.models.microbatch``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from roll.distributed.scheduler.batch import Batch


@dataclass
class PackedRow:
    """One micro-batch packed into a single row of ``T`` tokens (see the module docstring)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 per segment
    cu_seqlens: torch.Tensor  # [segments + 1] int32: segment starts, then T
    max_seqlen: int  # longest segment
    window: torch.Tensor  # [B, R] logits column scoring responses[:, t]
    num_tokens: int  # real tokens (T minus the padding segment)

    def to(self, device: torch.device | str) -> PackedRow:
        return PackedRow(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.cu_seqlens.to(device),
            self.max_seqlen,
            self.window.to(device),
            self.num_tokens,
        )


def sequence_lengths(batch: Batch) -> torch.Tensor:
    """Real tokens (prompt + response) per row, [B] int64."""
    return batch["attention_mask"].bool().sum(1)


def round_up(value: int, multiple: int) -> int:
    return max(multiple, math.ceil(value / multiple) * multiple)


def packed_length(batches: list[Batch], multiple: int) -> int:
    """The common packed row length of ``batches``: the largest token total, rounded up to ``multiple``."""
    return round_up(max(int(sequence_lengths(b).sum()) for b in batches), multiple)


def pack_rows(batch: Batch, multiple: int = 1, length: int | None = None) -> PackedRow:
    """Pack the rows of ``batch`` into one row of ``length`` tokens (default: the real token
    count rounded up to ``multiple``); raises if they do not fit. Built on the CPU (``.to(device)``)."""
    input_ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
    width = batch["responses"].shape[1]
    prompt_cols = input_ids.shape[1] - width
    prompt_len = mask[:, :prompt_cols].sum(1)
    lengths = mask.sum(1)
    total = int(lengths.sum())
    length = round_up(total, multiple) if length is None else length
    if total > length:
        raise ValueError(f"pack_rows: {total} tokens do not fit in a packed row of {length}")
    rows = torch.arange(len(lengths)).repeat_interleave(lengths)
    offsets = torch.cumsum(lengths, 0) - lengths  # where each sequence starts in the packed row
    positions = torch.arange(total) - offsets[rows]
    columns = (prompt_cols - prompt_len)[rows] + positions
    ids = torch.zeros(length, dtype=input_ids.dtype)
    ids[:total] = input_ids[rows, columns]
    position_ids = torch.cat([positions, torch.arange(length - total)])
    ends = torch.cumsum(lengths[lengths > 0], 0)
    bounds = [torch.zeros(1, dtype=torch.long), ends] + ([torch.tensor([length])] if length > total else [])
    cu_seqlens = torch.cat(bounds).to(torch.int32)
    window = offsets.unsqueeze(1) + prompt_len.unsqueeze(1) - 1 + torch.arange(width).unsqueeze(0)
    return PackedRow(
        input_ids=ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
        window=window.clamp(0, length - 1),
        num_tokens=total,
    )


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] index of the segment each packed token belongs to."""
    sizes = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.arange(len(sizes), device=cu_seqlens.device).repeat_interleave(sizes)
