"""Causal attention confined to each sequence of a packed row (``thd`` layout), in plain torch.

Inputs are ``query [T, heads, d]``, ``key/value [T, groups, d]`` (GQA when groups < heads) and
``cu_seqlens`` (segment starts, then T; see ``roll.models.packing``); the output is
``[T, heads, d]``. Every path computes the same function (a token attends to the earlier tokens of
its own segment and itself), so the choice is one of speed only:

- ``"sdpa"`` (default): one ``F.scaled_dot_product_attention(is_causal=True)`` per segment, so
  each call gets SDPA's fused causal kernels (flash / memory-efficient on CUDA) and memory grows
  with the sum of squared segment lengths, never with T^2. Exact on every device and dtype.
- ``"flex"``: one FlexAttention call with a document mask (compiled on CUDA, where the block mask
  also skips the blocks between segments; eager, unfused and forward-only on CPU).

>>> out = packed_attention(q, k, v, cu_seqlens, scale=d ** -0.5, kind="sdpa")
"""

from __future__ import annotations

import warnings
from functools import cache, lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from roll.models.packing import segment_ids

PACKED_ATTENTION_KINDS = ("sdpa", "flex")


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    kind: str = "sdpa",
    dropout: float = 0.0,
) -> torch.Tensor:
    """Per-segment causal attention of a packed row (see the module docstring)."""
    if kind == "sdpa":
        return _segment_sdpa(query, key, value, cu_seqlens, scale, dropout)
    if kind == "flex":
        if dropout > 0:
            raise ValueError("packing_attention 'flex' has no attention dropout; use 'sdpa'")
        if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
            raise ValueError("packing_attention 'flex' has no backward on CPU in torch; use 'sdpa'")
        return _flex(query, key, value, cu_seqlens, scale)
    raise ValueError(f"packing_attention: expected one of {list(PACKED_ATTENTION_KINDS)}, got {kind!r}")


def _segment_sdpa(q, k, v, cu_seqlens, scale: float, dropout: float) -> torch.Tensor:
    sizes = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    gqa = q.shape[1] != k.shape[1]
    parts = []
    for qs, ks, vs in zip(q.split(sizes), k.split(sizes), v.split(sizes)):
        out = F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0),
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        parts.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(parts)


@cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


@lru_cache(maxsize=8)
def _document_mask(bounds: tuple[int, ...], device: str) -> Any:
    """The block mask of a packed row (built once per micro-batch, reused by every layer)."""
    from torch.nn.attention.flex_attention import create_block_mask

    segments = segment_ids(torch.tensor(bounds, device=device))
    total = bounds[-1]

    def document_causal(b, h, q_idx, kv_idx):
        return (segments[q_idx] == segments[kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(document_causal, None, None, total, total, device=device)


def _flex(q, k, v, cu_seqlens, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = _document_mask(tuple(cu_seqlens.tolist()), str(q.device))
    args = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cuda":
        out = _compiled_flex()(*args, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(*args, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)
