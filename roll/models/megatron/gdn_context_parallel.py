"""Context parallelism for the Gated DeltaNet layers: a head-parallel all-to-all (Ulysses) around
the convolution and the recurrence.

Under context parallelism (CP) megatron-core hands every layer this rank's share of each sequence:
the sequence cut into ``2 x CP`` chunks, rank ``r`` holding chunks ``r`` and ``2 CP - 1 - r``
(``roll.models.context_parallel.zigzag_indices``; per sequence of a packed row, or of the whole
row on padded rows). Attention layers gather keys and values; a Gated DeltaNet layer's causal conv
and gated delta rule are recurrences over the whole sequence, so instead (megatron-core 0.16.1's
Gated DeltaNet has no CP; its Mamba layers do the same, ``MambaContextParallel``):

1. after the input projection, one all-to-all over the CP group turns [this rank's tokens, every
   head of the TP rank] into [every token, this rank's ``1 / CP`` of the heads] (``to_heads``),
   and the tokens are put in natural order;
2. the conv and the delta rule run over whole sequences (restarting at each packed sequence) on
   those heads, with the matching slice of the conv weight, ``A_log`` and ``dt_bias`` (taken in the
   forward, so their gradients land in the whole TP-rank parameter; megatron sums them over
   data x context parallel ranks as every parameter's);
3. the gated output norm runs per head there, and the inverse all-to-all (``to_sequence``) gives
   every rank its own tokens of every head back for ``out_proj``.

Each head block is a whole set of value heads with the key heads they read (value head j reads
key head j // (value heads / key heads)), so TP x CP must divide the key heads. The all-to-all is
its own adjoint and the reorder an index, so the backward is exact.

>>> exchange = HeadExchange(cp_group, cu_seqlens, local_tokens=mixed.shape[0])
>>> mixed = exchange.to_heads(mixed, [q, k, v, z, beta, alpha])   # widths of this TP rank's sections
>>> out = exchange.to_sequence(out)                                # [S, b, w] -> [S / CP, b, w x CP]
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist

from roll.models.context_parallel import global_order
from roll.models.ulysses import all_to_all


@lru_cache(maxsize=64)
def _orders(bounds: tuple[int, ...], cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank-major -> natural, natural -> rank-major) token indices (every layer asks the same)."""
    natural = global_order(bounds, cp_size)
    return natural, torch.argsort(natural)


class HeadExchange:
    """The all-to-alls of one Gated DeltaNet forward over ``group`` (see the module docstring).

    ``cu_seqlens``: the packed row's GLOBAL sequence bounds (None: padded rows, each row one
    sequence); ``local_tokens``: this rank's tokens per row (the sequence dim it holds)."""

    def __init__(self, group: Any, cu_seqlens: torch.Tensor | None, local_tokens: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        total = local_tokens * self.size
        bounds = (0, total) if cu_seqlens is None else tuple(int(b) for b in cu_seqlens.tolist())
        if bounds[-1] != total:
            raise ValueError(
                f"Gated DeltaNet under context parallelism: the sequences cover {bounds[-1]} tokens, "
                f"the CP group holds {total}"
            )
        self.natural, self.rank_major = _orders(bounds, self.size)

    def to_heads(self, local: torch.Tensor, sections: list[int]) -> torch.Tensor:
        """[S / CP, b, sum(sections)] (this rank's tokens; the TP rank's sections, each a whole
        number of heads) -> [S, b, sum(sections) / CP]: every token in natural order, this rank's
        block of each section, in the same section order."""
        s, b, _ = local.shape
        for width in sections:
            if width % self.size:
                raise ValueError(f"a section of {width} columns does not split over CP={self.size} ranks")
        parts = [p.unflatten(-1, (self.size, -1)) for p in local.split(sections, dim=-1)]
        chunks = torch.cat(parts, dim=-1).permute(2, 0, 1, 3)  # [CP (to rank), S / CP, b, w]
        got = all_to_all(chunks, self.group).flatten(0, 1)  # [S (rank-major), b, w]
        return got[self.natural.to(got.device)]

    def to_sequence(self, heads: torch.Tensor) -> torch.Tensor:
        """[S, b, w] (natural order, this rank's heads) -> [S / CP, b, w x CP] (this rank's tokens,
        every rank's heads in rank order)."""
        chunks = heads[self.rank_major.to(heads.device)].unflatten(0, (self.size, -1))
        got = all_to_all(chunks, self.group)  # [CP (from rank = head block), S / CP, b, w]
        return got.permute(1, 2, 0, 3).flatten(2)

    def block(self, param: torch.Tensor, sections: list[int] | None = None) -> torch.Tensor:
        """This rank's block of a TP-rank parameter along dim 0 (of each of ``sections``)."""
        parts = param.split(sections, dim=0) if sections else [param]
        picked = [p.unflatten(0, (self.size, -1))[self.rank] for p in parts]
        return picked[0] if len(picked) == 1 else torch.cat(picked, dim=0)
