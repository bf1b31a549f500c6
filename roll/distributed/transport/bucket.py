"""HF-named tensors packed into flat byte buckets: the unit every model-update transport moves.

A bucket is one flat ``uint8`` tensor holding several tensors back to back, each starting at a
256-byte aligned offset, plus a small picklable ``BucketMeta`` that says where each tensor lies.
Senders pack, transports move the flat buffer (NCCL/gloo broadcast, CUDA IPC, shared memory),
receivers unpack into views and hand them to ``strategy.load_weights``::

    for index, named in enumerate(iter_buckets(strategy.iter_hf_weights(), 512 << 20)):
        meta, flat = pack_bucket(named, version=step, index=index, last=False, out=buffers[index % 2])
        ...                                     # move (meta, flat) to the receiver
    engine.load_weights(iter(unpack_bucket(meta, flat)))   # views into flat, no copies

Padding bytes between tensors are zeroed when packing, so two buckets with the same tensors are
equal byte for byte (the checksums in ``roll.distributed.transport.checksum`` rely on it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 256


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lies in a bucket: ``flat[offset : offset + nbytes]`` viewed as dtype/shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketMeta:
    """The tensors of one bucket; ``nbytes`` is the flat buffer's used length (a multiple of 256).

    ``version`` is the weight version this update installs, ``index`` the bucket's position in the
    sender's stream and ``last`` marks the sender's final bucket of the update.
    """

    tensors: list[TensorMeta]
    nbytes: int
    version: int
    index: int
    last: bool

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the bucket alignment (256)."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into lists whose aligned sizes sum to at most ``bucket_bytes``.

    A tensor bigger than ``bucket_bytes`` gets a bucket of its own. Lazy: a bucket is yielded as
    soon as the next tensor does not fit, so a generator source is consumed one bucket ahead at most.
    """
    for bucket, _ in iter_buckets_with_last(named_tensors, bucket_bytes):
        yield bucket


def iter_buckets_with_last(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Like ``iter_buckets`` but yields ``(bucket, last)``; an empty source yields one empty last bucket."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    current: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in named_tensors:
        size = align(tensor_nbytes(tensor))
        if current and used + size > bucket_bytes:
            yield current, False
            current, used = [], 0
        current.append((name, tensor))
        used += size
    yield current, True


def layout(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    """The ``TensorMeta`` of each tensor placed back to back at aligned offsets, and the total bytes."""
    metas: list[TensorMeta] = []
    offset = 0
    for name, tensor in named:
        nbytes = tensor_nbytes(tensor)
        metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset, nbytes))
        offset += align(nbytes)
    return metas, offset


def write_tensor(flat: torch.Tensor, meta: TensorMeta, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` into its slot of ``flat`` and zero the slot's padding."""
    end = meta.offset + meta.nbytes
    if meta.nbytes:
        tensor_view(flat, meta).copy_(tensor)
    pad_end = meta.offset + align(meta.nbytes)
    if pad_end > end:
        flat[end:pad_end].zero_()


def write_tensors(flat: torch.Tensor, metas: list[TensorMeta], tensors: list[torch.Tensor]) -> None:
    """``write_tensor`` for many tensors with few kernel launches: consecutive contiguous tensors on
    ``flat``'s device whose sizes are multiples of 256 bytes lie back to back, so each such run is
    one ``torch.cat`` into its byte range (MoE models yield thousands of small tensors)."""
    run: list[int] = []

    def flush() -> None:
        if len(run) == 1:
            write_tensor(flat, metas[run[0]], tensors[run[0]])
        elif run:
            first, last = metas[run[0]], metas[run[-1]]
            parts = [tensors[i].reshape(-1).view(torch.uint8) for i in run]
            torch.cat(parts, out=flat[first.offset : last.offset + last.nbytes])
        run.clear()

    for i, (meta, tensor) in enumerate(zip(metas, tensors)):
        if meta.nbytes % ALIGN == 0 and tensor.is_contiguous() and tensor.device == flat.device:
            run.append(i)
            continue
        flush()
        write_tensor(flat, meta, tensor)
    flush()


def tensor_view(flat: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """``meta``'s tensor as a view into ``flat`` (no copy)."""
    raw = flat[meta.offset : meta.offset + meta.nbytes]
    return raw.view(meta.dtype).view(meta.shape)


def pack_bucket(
    named: list[tuple[str, torch.Tensor]],
    version: int,
    index: int,
    last: bool,
    out: torch.Tensor | None = None,
) -> tuple[BucketMeta, torch.Tensor]:
    """Copy ``named`` into one flat uint8 buffer; returns ``(meta, flat)``.

    The buffer lives on the tensors' device (on ``out``'s device when ``out`` is given). ``out`` is
    reused when it is a 1-D uint8 tensor of at least ``meta.nbytes`` bytes (``flat`` is then its
    prefix), which is how senders double-buffer; otherwise a new buffer is allocated.
    """
    metas, total = layout(named)
    if out is not None and (out.dtype != torch.uint8 or out.dim() != 1):
        raise ValueError(f"out must be a 1-D uint8 tensor, got {out.dtype} with shape {tuple(out.shape)}")
    if out is not None and out.numel() >= total:
        flat = out[:total]
    else:
        device = out.device if out is not None else (named[0][1].device if named else torch.device("cpu"))
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    write_tensors(flat, metas, [tensor for _, tensor in named])
    return BucketMeta(metas, total, version, index, last), flat


def tight_nbytes(meta: BucketMeta) -> int:
    """The bucket's size with its tensors back to back (no padding)."""
    return sum(t.nbytes for t in meta.tensors)


def tight_bucket(meta: BucketMeta, flat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's tensors back to back without padding, as engines that flatten a bucket
    themselves lay it out (SGLang's ``FlattenedTensorBucket``): a prefix of ``flat`` when no tensor
    before the last is padded (every size a multiple of 256 bytes, as in most LLM layers), else
    copied into ``out`` (at least ``tight_nbytes(meta)`` bytes) in one kernel."""
    nbytes, offset = tight_nbytes(meta), 0
    for t in meta.tensors:
        if t.offset != offset:
            break
        offset += t.nbytes
    else:
        return flat[:nbytes]
    if out is None or out.numel() < nbytes:
        raise ValueError(f"bucket {meta.index} needs a {nbytes}-byte buffer to lie without padding")
    parts = [flat[t.offset : t.offset + t.nbytes] for t in meta.tensors]
    return torch.cat(parts, out=out[:nbytes])


def unpack_bucket(meta: BucketMeta, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as ``(name, view)`` pairs into ``flat`` (no copies)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D uint8 tensor, got {flat.dtype} with shape {tuple(flat.shape)}")
    if flat.numel() < meta.nbytes:
        raise ValueError(f"bucket {meta.index} needs {meta.nbytes} bytes but the buffer holds {flat.numel()}")
    return [(t.name, tensor_view(flat, t)) for t in meta.tensors]
