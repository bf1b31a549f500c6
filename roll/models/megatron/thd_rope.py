"""RoPE over packed (``thd``) rows in one gather instead of megatron-core's per-sequence loop.

megatron-core 0.16's ``rope_utils._apply_rotary_pos_emb_thd`` (the path without TransformerEngine)
compares a device tensor with an int, calls ``.tolist()`` on ``cu_seqlens`` and splits the row
into one slice per sequence for every query and key of every layer: two host syncs and a Python
loop per call, which on an H100 made a packed 1.5B train step slower than the padded one although
attention itself was faster (docs/packing.md). ``apply_thd`` computes the same frequencies with
one index: each token's position inside its sequence (``freqs[pos]``), or its position in the row
when the frequencies cover the whole row (megatron's "exact mapping" case), then applies the same
``_apply_rotary_pos_emb_bshd`` to the whole row. Context parallelism (whose slices are zig-zag)
keeps megatron's own function.

    install()   # once per process, before the first packed forward (build_chunks does it)
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from roll.models.positions import packed_positions

_ORIGINAL: dict[str, Any] = {}
_EXPECTED = ("t", "cu_seqlens", "freqs", "rotary_interleaved", "multi_latent_attention", "mscale", "cp_group")


# The last row's positions: every query and key of every layer of a micro-batch passes the same
# ``cu_seqlens`` tensor, so they are computed once per micro-batch, not twice per layer.
_LAST: list[tuple[torch.Tensor, int, torch.Tensor]] = []


def _row_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    if _LAST and _LAST[0][0] is cu_seqlens and _LAST[0][1] == total:
        return _LAST[0][2]
    positions = packed_positions(cu_seqlens, total)
    _LAST[:] = [(cu_seqlens, total, positions)]
    return positions


def apply_thd(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
    cp_group: Any = None,
) -> torch.Tensor:
    """Same result as megatron-core's ``_apply_rotary_pos_emb_thd`` (see the module docstring)."""
    from megatron.core.models.common.embeddings import rope_utils

    if cp_group is None or cp_group.size() > 1:
        return _ORIGINAL["thd"](
            t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group
        )
    total = t.size(0)
    if freqs.size(0) == total:  # frequencies of every position of the row (megatron's case 1)
        picked = freqs
    else:
        picked = freqs[_row_positions(cu_seqlens.to(freqs.device), total)]
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        picked,
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention,
        mscale=mscale,
    ).squeeze(1)


def install() -> bool:
    """Route megatron-core's thd RoPE through ``apply_thd``; False (nothing changed) when the
    installed megatron-core's function has another signature than the one this replaces."""
    from megatron.core.models.common.embeddings import rope_utils

    current = rope_utils._apply_rotary_pos_emb_thd
    if current is apply_thd:
        return True
    if tuple(inspect.signature(current).parameters) != _EXPECTED:
        return False
    _ORIGINAL["thd"] = current
    rope_utils._apply_rotary_pos_emb_thd = apply_thd
    return True
