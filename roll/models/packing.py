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

from roll.core.batch import Batch
from roll.models.positions import cu_seqlens_from, packed_positions


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


def packed_length(batches: list[Batch], multiple: int, segment_multiple: int = 1) -> int:
    """The common packed row length of ``batches``: the largest token total (each sequence rounded
    up to ``segment_multiple``), rounded up to ``multiple``."""
    totals = [_segment_lengths(sequence_lengths(b), segment_multiple).sum() for b in batches]
    return round_up(int(max(totals)), multiple)


def _segment_lengths(lengths: torch.Tensor, segment_multiple: int) -> torch.Tensor:
    return (lengths + segment_multiple - 1) // segment_multiple * segment_multiple


def pack_rows(
    batch: Batch, multiple: int = 1, length: int | None = None, segment_multiple: int = 1
) -> PackedRow:
    """Pack the rows of ``batch`` into one row of ``length`` tokens (default: the token count
    rounded up to ``multiple``); raises if they do not fit. ``segment_multiple``: every sequence's
    segment is padded (after its last token) to a multiple of it, as context parallelism needs;
    ``length`` must then be a multiple of it too. Built on the CPU (``.to(device)``)."""
    input_ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
    width = batch["responses"].shape[1]
    prompt_cols = input_ids.shape[1] - width
    prompt_len = mask[:, :prompt_cols].sum(1)
    lengths = mask.sum(1)
    segments = _segment_lengths(lengths, segment_multiple)
    total = int(segments.sum())
    length = round_up(total, multiple) if length is None else length
    if total > length or (length - total) % segment_multiple:
        raise ValueError(f"pack_rows: {total} tokens do not fit in a packed row of {length}")
    offsets = cu_seqlens_from(segments)[:-1]  # where each sequence starts in the packed row
    tokens = int(lengths.sum())
    rows = torch.arange(len(lengths)).repeat_interleave(lengths)
    within = packed_positions(cu_seqlens_from(lengths), tokens)  # token's place in its run
    ids = torch.zeros(length, dtype=input_ids.dtype)
    ids[offsets[rows] + within] = input_ids[rows, (prompt_cols - prompt_len)[rows] + within]
    sizes = torch.cat([segments[segments > 0], torch.tensor([length - total])])
    sizes = sizes[sizes > 0]
    cu_seqlens = cu_seqlens_from(sizes).to(torch.int32)
    position_ids = packed_positions(cu_seqlens, length)
    window = offsets.unsqueeze(1) + prompt_len.unsqueeze(1) - 1 + torch.arange(width).unsqueeze(0)
    return PackedRow(
        input_ids=ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(sizes.max()),
        window=window.clamp(0, length - 1),
        num_tokens=tokens,
    )


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] index of the segment each packed token belongs to."""
    sizes = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.arange(len(sizes), device=cu_seqlens.device).repeat_interleave(sizes)
