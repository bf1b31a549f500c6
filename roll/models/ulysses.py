"""Ulysses sequence parallelism (DeepSpeed-Ulysses) for Hugging Face models: the all-to-all and the
attention function that wraps it.

A group of N ranks holds one micro-batch, each rank 1/N of every row's columns (sequence shards).
Everything but attention is per token, so it runs on the local shard as it is. Attention needs
the whole sequence: before it, one all-to-all turns ``[B, heads, S/N, d]`` (every head, this
rank's columns) into ``[B, heads/N, S, d]`` (this rank's heads, every column); after it, the
inverse all-to-all turns the output back. KV heads fewer than N are replicated first (each rank
then holds one KV head, the one its query heads use), as DeepSpeed and ROLL do.

The function is registered in transformers' attention registry (``AttentionInterface``) as
``ULYSSES_ATTENTION``; a model switched to it (``use_ulysses_attention``) calls it from every
attention layer of its own code. transformers builds no mask for a registered name it has no mask
function for, so the mask comes from the micro-batch the strategy set with ``set_ulysses_batch``:
padded rows attend causally to their real tokens (``key_mask``), packed rows per sequence
(``cu_seqlens``, through ``roll.models.packed_attention``). The batch stays set after the forward,
because activation checkpointing runs the attention again during the backward.

>>> use_ulysses_attention(model, group)                  # once, after loading
>>> set_ulysses_batch(UlyssesBatch(group, key_mask=mask))  # before each forward of a micro-batch
>>> out = model(input_ids=ids[:, lo:hi], position_ids=pos[:, lo:hi])   # global positions
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from roll.configs.errors import ConfigError
from roll.models.packed_attention import packed_attention

ULYSSES_ATTENTION = "roll_ulysses"


@dataclass
class UlyssesBatch:
    """The micro-batch the group's attention runs on: ``key_mask`` [B, S] (padded rows: which
    columns are real tokens) or ``cu_seqlens`` (one packed row: sequence bounds over S)."""

    group: Any
    key_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    packing_attention: str = "auto"
    mask: torch.Tensor | None = None  # padded rows: built from key_mask by the first layer, then reused


_ACTIVE: UlyssesBatch | None = None


def set_ulysses_batch(batch: UlyssesBatch) -> None:
    """The micro-batch the next forward (and its backward's recomputation) attends over."""
    global _ACTIVE
    _ACTIVE = batch


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dim 0 goes to rank ``i``; chunk ``j`` of the result came from rank ``j``. The
    exchange is its own adjoint, so the backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, chunks: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return exchange(chunks, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return exchange(grad, ctx.group), None


def all_to_all(chunks: torch.Tensor, group: Any) -> torch.Tensor:
    """``exchange`` with autograd: chunk ``i`` of dim 0 goes to rank ``i`` (the backward is the
    same exchange of the gradient)."""
    return _AllToAll.apply(chunks, group)


def exchange(chunks: torch.Tensor, group: Any) -> torch.Tensor:
    """``all_to_all_single`` over equal dim-0 chunks (NCCL on CUDA; gloo has it on CPU too)."""
    chunks = chunks.contiguous()
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H, S/N, d] (all heads, this rank's columns) -> [B, H/N, S, d] (this rank's heads)."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    chunks = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # [N (to rank), B, H/N, S/N, d]
    got = _AllToAll.apply(chunks, group)  # [N (from rank = column shard), B, H/N, S/N, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H/N, S, d] (this rank's heads) -> [B, H, S/N, d] (all heads, this rank's columns)."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4)  # [N (column shard), B, H/N, S/N, d]
    got = _AllToAll.apply(chunks, group)  # [N (from rank = head shard), B, H/N, S/N, d]
    return got.transpose(0, 1).reshape(b, n * h, s // n, d)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q/k/v ``[B, heads, S/N, d]`` of this rank's
    columns in, ``[B, S/N, heads, d]`` out (the layer reshapes it for ``o_proj``)."""
    state = _ACTIVE
    if state is None:
        raise RuntimeError("ulysses attention: no micro-batch set (set_ulysses_batch)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("ulysses attention: sliding-window attention layers are not supported")
    group = state.group
    n = dist.get_world_size(group)
    if key.shape[1] < n:  # each rank needs the KV head of its query heads
        key = key.repeat_interleave(n // key.shape[1], dim=1)
        value = value.repeat_interleave(n // value.shape[1], dim=1)
    q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if state.cu_seqlens is not None:
        out = packed_attention(
            q[0].transpose(0, 1),
            k[0].transpose(0, 1),
            v[0].transpose(0, 1),
            state.cu_seqlens,
            scale,
            kind=state.packing_attention,
            dropout=dropout,
            max_seqlen=state.max_seqlen,
        )
        out = out.transpose(0, 1).unsqueeze(0)
    else:
        if state.mask is None:
            state.mask = padded_causal_mask(state.key_mask.to(q.device))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=state.mask,
            dropout_p=dropout,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return heads_to_seq(out, group).transpose(1, 2), None


def padded_causal_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: causal over the real tokens of each row. A padding query attends to
    itself only, so its (unused) output stays finite and its gradient zero."""
    s = key_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=key_mask.device).tril()
    mask = causal & key_mask.bool()[:, None, :]
    return (mask | torch.eye(s, dtype=torch.bool, device=key_mask.device)).unsqueeze(1)


def check_heads(config: Any, size: int, path: str) -> None:
    """``size`` must divide the attention heads, and divide or be a multiple of the KV heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % size:
        raise ConfigError(path, f"{size} does not divide the model's {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise ConfigError(
            path,
            f"{size} neither divides the model's {kv_heads} KV heads nor is a multiple of them "
            "(KV heads are replicated only by a whole factor)",
        )


def use_ulysses_attention(model: nn.Module) -> None:
    """Register ``ulysses_attention`` and switch every attention layer of ``model`` to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ULYSSES_ATTENTION
