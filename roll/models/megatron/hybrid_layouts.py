"""How Qwen3-Next's fused HF tensors become megatron-core parameters of one tensor-parallel rank,
and back: the three layouts ``weight_mapping`` names ``qkv_gated``, ``gdn_in`` and ``gdn_conv``.

HF (transformers' Qwen3-Next, the checkpoint) and megatron-core 0.16.1 order the rows of these
tensors differently (``nk`` key heads of ``dk``, ``nv`` value heads of ``dv``, ``r = nv / nk`` value
heads per key head, ``_r`` = this TP rank's share):

==============  ==================================================  ===========================================
layout          HF rows                                             megatron rows of TP rank r
==============  ==================================================  ===========================================
``qkv_gated``   q_proj: per head [q (d); gate (d)]; k_proj; v_proj  per query group [its q heads; their gates; k; v]
``gdn_in``      in_proj_qkvz: per key head [q; k; r v; r z];        [q_r; k_r; v_r; z_r; beta_r; alpha_r]
                in_proj_ba: per key head [r beta; r alpha]           (``GatedDeltaNet.in_proj``)
``gdn_conv``    conv1d: [q (nk dk); k (nk dk); v (nv dv)]           [q_r; k_r; v_r] (``GatedDeltaNet.conv1d``)
``gdn_in_split`` Qwen3.5's in_proj_qkv [q; k; v] (as conv1d),       [q_r; k_r; v_r; z_r; beta_r; alpha_r]
                in_proj_z [nv dv], in_proj_b [nv], in_proj_a [nv]    (``GatedDeltaNet.in_proj``)
==============  ==================================================  ===========================================

A rank's heads are contiguous in both, so ``qkv_gated`` and ``gdn_in`` read a contiguous block of
every HF tensor; ``gdn_conv`` (and ``gdn_in_split``'s in_proj_qkv) reads the rank's block of each
of its three sections (``conv_ranges``).

>>> fuse_gdn_in([qkvz_rows, ba_rows], LinearHeads(2, 4, 8, 12))      # this rank's in_proj weight
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinearHeads:
    """Gated DeltaNet head counts and widths (the whole model's, not a TP rank's)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @property
    def ratio(self) -> int:
        """Value heads per key head."""
        return self.value_heads // self.key_heads

    def conv_sections(self) -> list[int]:
        """Rows of the conv weight's q, k and v sections."""
        qk = self.key_heads * self.key_dim
        return [qk, qk, self.value_heads * self.value_dim]


# -------------------------------------------------------------------------------- gated attention
def fuse_qkv_gated(pieces: list[torch.Tensor], head_dim: int, heads_per_group: int) -> torch.Tensor:
    """megatron's ``linear_qkv`` with output gate from this rank's q_proj / k_proj / v_proj rows."""
    q, k, v = pieces
    groups, rest = k.shape[0] // head_dim, q.shape[1:]
    heads = q.reshape(groups, heads_per_group, 2, head_dim, *rest)
    query = heads[:, :, 0].reshape(groups, heads_per_group * head_dim, *rest)
    gate = heads[:, :, 1].reshape(groups, heads_per_group * head_dim, *rest)
    parts = (query, gate, k.reshape(groups, head_dim, *rest), v.reshape(groups, head_dim, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def unfuse_qkv_gated(shard: torch.Tensor, head_dim: int, heads_per_group: int) -> list[torch.Tensor]:
    """Inverse of ``fuse_qkv_gated``: [q_proj rows, k_proj rows, v_proj rows] of this rank."""
    q_rows, rest = heads_per_group * head_dim, shard.shape[1:]
    grouped = shard.reshape(-1, 2 * q_rows + 2 * head_dim, *rest)
    query, gate, k, v = grouped.split([q_rows, q_rows, head_dim, head_dim], dim=1)
    per_head = [t.reshape(-1, heads_per_group, head_dim, *rest) for t in (query, gate)]
    q = torch.stack(per_head, dim=2).reshape(-1, *rest)
    return [q, k.reshape(-1, *rest), v.reshape(-1, *rest)]


# ---------------------------------------------------------------------------------- Gated DeltaNet
def _qkvz_split(heads: LinearHeads) -> list[int]:
    r = heads.ratio
    return [heads.key_dim, heads.key_dim, r * heads.value_dim, r * heads.value_dim]


def fuse_gdn_in(pieces: list[torch.Tensor], heads: LinearHeads) -> torch.Tensor:
    """megatron's ``in_proj`` of this rank from its in_proj_qkvz and in_proj_ba rows."""
    qkvz, ba = pieces
    split, rest = _qkvz_split(heads), qkvz.shape[1:]
    groups = qkvz.shape[0] // sum(split)
    q, k, v, z = qkvz.reshape(groups, sum(split), *rest).split(split, dim=1)
    b, a = ba.reshape(groups, 2 * heads.ratio, *rest).split([heads.ratio, heads.ratio], dim=1)
    return torch.cat([t.reshape(-1, *rest) for t in (q, k, v, z, b, a)], dim=0)


def unfuse_gdn_in(shard: torch.Tensor, heads: LinearHeads) -> list[torch.Tensor]:
    """Inverse of ``fuse_gdn_in``: [in_proj_qkvz rows, in_proj_ba rows] of this rank."""
    split, r, rest = _qkvz_split(heads), heads.ratio, shard.shape[1:]
    groups = shard.shape[0] // (sum(split) + 2 * r)
    sizes = [groups * n for n in split] + [groups * r, groups * r]
    q, k, v, z, b, a = (t.reshape(groups, -1, *rest) for t in shard.split(sizes, dim=0))
    qkvz = torch.cat([q, k, v, z], dim=1).reshape(-1, *rest)
    return [qkvz, torch.cat([b, a], dim=1).reshape(-1, *rest)]


def conv_ranges(length: int, heads: LinearHeads, tp_size: int, tp_rank: int) -> list[tuple[int, int]]:
    """[start, stop) rows of the HF conv weight that make TP rank ``tp_rank``'s conv1d: its block
    of each of the q, k, v sections."""
    sections = heads.conv_sections()
    if sum(sections) != length:
        raise ValueError(f"conv1d has {length} rows; the linear-attention heads make {sum(sections)}")
    ranges, start = [], 0
    for rows in sections:
        if rows % tp_size:
            raise ValueError(f"a conv1d section of {rows} rows does not split into {tp_size} shards")
        per_rank = rows // tp_size
        ranges.append((start + tp_rank * per_rank, start + (tp_rank + 1) * per_rank))
        start += rows
    return ranges


def unfuse_gdn_conv(shard: torch.Tensor, heads: LinearHeads) -> list[torch.Tensor]:
    """This rank's conv1d weight as its [q, k, v] section blocks (``conv_ranges``' order)."""
    sections = heads.conv_sections()
    scale = sum(sections) // shard.shape[0]  # the TP size
    return list(shard.split([rows // scale for rows in sections], dim=0))


# ------------------------------------------------------ Qwen3.5's split Gated DeltaNet projections
def split_in_ranges(
    length: int, heads: LinearHeads, tp_size: int, tp_rank: int
) -> list[tuple[int, int]] | None:
    """``gdn_in_split``: the blocks of Qwen3.5's in_proj_qkv that TP rank ``tp_rank`` reads (its
    block of each of the q, k, v sections, as for conv1d); None for in_proj_z / _b / _a (one
    contiguous block, the caller's plain split), which a length other than q+k+v tells apart."""
    if length != sum(heads.conv_sections()):
        return None
    return conv_ranges(length, heads, tp_size, tp_rank)


def _split_in_sizes(heads: LinearHeads, scale: int) -> list[int]:
    """Rows of q, k, v, z, beta, alpha in megatron's in_proj of one of ``scale`` TP ranks."""
    q, k, v = (rows // scale for rows in heads.conv_sections())
    return [q, k, v, v, heads.value_heads // scale, heads.value_heads // scale]


def unfuse_gdn_in_split(shard: torch.Tensor, heads: LinearHeads) -> list[torch.Tensor]:
    """This rank's in_proj as its [q, k, v, z, beta, alpha] blocks (``join_gdn_in_split`` puts the
    ranks' blocks back together as in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""
    scale = sum(_split_in_sizes(heads, 1)) // shard.shape[0]  # the TP size
    return list(shard.split(_split_in_sizes(heads, scale), dim=0))


def join_gdn_in_split(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """[in_proj_qkv, in_proj_z, in_proj_b, in_proj_a] from the whole q, k, v, z, beta, alpha."""
    q, k, v, z, b, a = pieces
    return [torch.cat([q, k, v], dim=0), z, b, a]
