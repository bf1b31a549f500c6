"""Exact per-tensor checksums of packed buckets, cheap enough to compute on every update.

A tensor's checksum is two int64 numbers over its bytes (zero-padded to 256 bytes) read as int64
words and grouped into 256-byte blocks ``B_0 .. B_{n-1}`` (each the wrapping sum of its 32 words):
``(sum_i B_i, sum_i (i + 1) * B_i)``, both modulo 2**64. Integer sums do not depend on reduction
order, so the sender's GPU, a receiver's GPU and a CPU all get the same numbers; the weighted term
changes when blocks move (a swapped TP shard, rows in the wrong order).

A whole bucket costs a handful of kernels however many tensors it holds: one block reduction over
the flat buffer, two cumulative sums and a gather at the tensors' block boundaries.

    sums = bucket_checksums(meta, flat)          # int64 [len(meta.tensors), 2], on flat's device
    assert sums[0].tolist() == list(tensor_checksum(unpack_bucket(meta, flat)[0][1]))
"""

from __future__ import annotations

import torch

from roll.distributed.transport.bucket import ALIGN, BucketMeta, align, tensor_nbytes

_WORDS_PER_BLOCK = ALIGN // 8


def block_sums(flat: torch.Tensor) -> torch.Tensor:
    """Wrapping int64 sum of each 256-byte block of ``flat`` (uint8, length a multiple of 256)."""
    if flat.numel() % ALIGN:
        raise ValueError(f"flat buffer length {flat.numel()} is not a multiple of {ALIGN}")
    return flat.view(torch.int64).view(-1, _WORDS_PER_BLOCK).sum(dim=1)


def bucket_checksums(meta: BucketMeta, flat: torch.Tensor) -> torch.Tensor:
    """Checksums of every tensor of the bucket as an int64 tensor [n, 2] on ``flat``'s device."""
    n = len(meta.tensors)
    if n == 0:
        return torch.zeros(0, 2, dtype=torch.int64, device=flat.device)
    blocks = block_sums(flat[: meta.nbytes])
    index = torch.arange(1, blocks.numel() + 1, dtype=torch.int64, device=flat.device)
    zero = torch.zeros(1, dtype=torch.int64, device=flat.device)
    plain = torch.cat([zero, blocks.cumsum(0)])
    weighted = torch.cat([zero, (blocks * index).cumsum(0)])
    bounds = [(t.offset // ALIGN, (t.offset + align(t.nbytes)) // ALIGN) for t in meta.tensors]
    where = torch.tensor(bounds, dtype=torch.int64).to(flat.device, non_blocking=True)
    start, end = where[:, 0], where[:, 1]
    total = plain[end] - plain[start]
    # Weights restart at 1 for each tensor: sum (b - start + 1) B_b = W[end] - W[start] - start * total.
    positional = weighted[end] - weighted[start] - start * total
    return torch.stack([total, positional], dim=1)


def tensor_checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """The checksum of one tensor, equal to its entry in ``bucket_checksums`` of any bucket holding it."""
    nbytes = tensor_nbytes(tensor)
    flat = torch.zeros(align(nbytes), dtype=torch.uint8, device=tensor.device)
    if nbytes:
        flat[:nbytes].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
    blocks = block_sums(flat)
    index = torch.arange(1, blocks.numel() + 1, dtype=torch.int64, device=flat.device)
    return int(blocks.sum()), int((blocks * index).sum())


def first_mismatch(
    expected: list[tuple[str, tuple[int, int]]], actual: dict[str, tuple[int, int]]
) -> str | None:
    """The first name (in ``expected``'s order) whose checksum differs from ``actual`` or is missing."""
    for name, sums in expected:
        if tuple(actual.get(name, ())) != tuple(sums):
            return name
    return None
