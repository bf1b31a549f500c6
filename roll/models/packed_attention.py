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
- ``"varlen"``: torch's variable-length FlashAttention (``torch.nn.attention.varlen``), one kernel
  over the whole row with ``cu_seqlens``, forward and backward, GQA in the kernel. CUDA, bf16/fp16.
- ``"auto"`` (the default): ``varlen`` on CUDA with a floating dtype it takes, otherwise ``sdpa``.

On an H200 at the Qwen2.5-1.5B shape the per-segment loop was the slowest of these (one kernel and
one host sync per segment per layer); docs/packing.md has the table and the command.

>>> out = packed_attention(q, k, v, cu_seqlens, scale=d ** -0.5, kind="auto", max_seqlen=longest)
"""

from __future__ import annotations

import inspect
import warnings
from functools import cache, lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from roll.models.packing import segment_ids

PACKED_ATTENTION_KINDS = ("auto", "sdpa", "flex", "varlen")
VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    kind: str = "auto",
    dropout: float = 0.0,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Per-segment causal attention of a packed row (see the module docstring). ``max_seqlen``: the
    longest segment, if the caller knows it (saves ``varlen`` a host sync)."""
    if kind == "auto":
        kind = resolve_kind(query, dropout)
    if kind == "varlen":
        if dropout > 0:
            raise ValueError("packing_attention 'varlen' has no attention dropout; use 'sdpa'")
        return _varlen(query, key, value, cu_seqlens, scale, max_seqlen)
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


def resolve_kind(query: torch.Tensor, dropout: float = 0.0) -> str:
    """What ``"auto"`` runs for ``query``: ``varlen`` where it can, else ``sdpa``."""
    if query.device.type == "cuda" and query.dtype in VARLEN_DTYPES and dropout == 0 and varlen_available():
        return "varlen"
    return "sdpa"


@cache
def varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _varlen_call() -> tuple[Any, dict[str, Any], bool]:
    """torch's ``varlen_attn``, its causal keyword (torch 2.10 took ``is_causal``, later releases a
    ``window_size``), and whether it takes ``enable_gqa``."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def _varlen(q, k, v, cu_seqlens, scale: float, max_seqlen: int | None) -> torch.Tensor:
    if q.device.type != "cuda" or q.dtype not in VARLEN_DTYPES:
        raise ValueError(
            f"packing_attention 'varlen' runs on CUDA in bf16/fp16 (got {q.device.type}, {q.dtype}); "
            "use 'auto' or 'sdpa'"
        )
    varlen_attn, causal, takes_gqa = _varlen_call()
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    kwargs = dict(causal, scale=scale)
    if q.shape[1] != k.shape[1]:
        if takes_gqa:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


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
