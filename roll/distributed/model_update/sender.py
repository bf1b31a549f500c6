"""Sender side of a link: stream HF-named tensors into double-buffered buckets and send them.

The generator's tensors are collected until the next one does not fit (so at most one bucket of
them is alive); then they are copied into a free buffer in a few launches (``write_tensors``) and
sent, and collecting continues for the other buffer. On GPU the copies run on a side stream and
the broadcast is issued from it, so the generator's gathers and the packing of bucket k+1 overlap
the transfer of bucket k.
A buffer is reused only after its broadcast finished (a stream wait, not a host wait) and every
colocated receiver acknowledged it (they read it in place).

A link whose remote engines build their own group (``LinkSpec.engine_group``: SGLang's
``update_weights_from_distributed`` with ``load_format="flattened_bucket"``) gets each bucket as
one broadcast of its tensors back to back (``tight_bucket``); a tensor whose place there would not
suit its dtype (an offset not a multiple of its element size) starts a new bucket, as the engine
views its bytes in place.

    sender = BucketSender(link, device, bucket_bytes=512 << 20)
    result = sender.send(strategy.iter_hf_weights(), version=step)
    result.names, result.checksums, result.nbytes
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from roll.distributed.model_update.errors import ModelUpdateError
from roll.distributed.transport.bucket import (
    BucketMeta,
    TensorMeta,
    align,
    tensor_nbytes,
    tight_bucket,
    tight_nbytes,
    write_tensors,
)
from roll.distributed.transport.checksum import bucket_checksums
from roll.distributed.transport.ipc import IpcHandle, allocate_shared, release_shared
from roll.distributed.transport.link import Link


@dataclass
class SendResult:
    names: list[str] = field(default_factory=list)
    checksums: list[tuple[int, int]] = field(default_factory=list)
    nbytes: int = 0
    buckets: int = 0
    # Host time inside the weight generator (gather + convert, as far as the host waits on them),
    # blocked on buffer reuse, and in total.
    iter_s: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    # The weight version the update carried.
    version: int = 0


@dataclass
class _Slot:
    flat: torch.Tensor | None = None
    handle: IpcHandle | None = None
    generation: int = 0
    work: Any = None
    acks_pending: bool = False
    # Index of the last bucket sent from this slot (slots are drained in send order).
    index: int = -1
    released: bool = True
    # The bucket without padding, for engines that lay it out so (allocated when first needed).
    tight: torch.Tensor | None = None


def stream_context(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class BucketSender:
    """Packs and sends one update over ``link`` (this rank must be the link's sender)."""

    def __init__(self, link: Link, device: torch.device, bucket_bytes: int):
        if not link.is_sender:
            raise ValueError(f"link {link.spec.name}: this member is a receiver, not the sender")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.link = link
        self.device = device
        self.bucket_bytes = align(bucket_bytes)
        self.shared = bool(link.spec.local_receivers)
        self.tight = link.spec.engine_group and bool(link.spec.remote_receivers)
        self.slots = [_Slot(), _Slot()]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The last packed bucket's source tensors and the event after their copies: kept alive
        # until then (one event per bucket instead of a ``record_stream`` per tensor).
        self._held: tuple[list[torch.Tensor], torch.cuda.Event] | None = None

    def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SendResult:
        result = SendResult(version=version)
        sums: list[torch.Tensor] = []
        start = time.perf_counter()
        index, metas, tensors, used, tight_used = 0, [], [], 0, 0
        iterator = iter(named)
        while True:
            t0 = time.perf_counter()
            item = next(iterator, None)
            result.iter_s += time.perf_counter() - t0
            if item is None:
                break
            name, tensor = item
            nbytes = tensor_nbytes(tensor)
            size = align(nbytes)
            misplaced = self.tight and tight_used % tensor.element_size() != 0
            if metas and (used + size > self.bucket_bytes or misplaced):
                sums.append(
                    self._send_bucket(BucketMeta(metas, used, version, index, False), tensors, result)
                )
                index, metas, tensors, used, tight_used = index + 1, [], [], 0, 0
            metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), used, nbytes))
            tensors.append(tensor)
            used += size
            tight_used += nbytes
        sums.append(self._send_bucket(BucketMeta(metas, used, version, index, True), tensors, result))
        self._release_held()
        for slot in sorted(self.slots, key=lambda s: s.index):
            self._wait_free(slot, result)
        if self.stream is not None:
            self.stream.synchronize()
        result.checksums = [tuple(row) for row in torch.cat(sums).cpu().tolist()]
        result.total_s = time.perf_counter() - start
        return result

    def _send_bucket(self, meta: BucketMeta, tensors: list[torch.Tensor], result: SendResult) -> torch.Tensor:
        """Pack one bucket into a free buffer and send it; returns its checksums (on the device)."""
        if not meta.nbytes:  # an empty last bucket (a rank with nothing to send): metadata only
            self.link.control.send((meta, None))
            result.names.extend(meta.names)
            result.buckets += 1
            return torch.zeros(len(meta.tensors), 2, dtype=torch.int64, device=self.device)
        slot = self._acquire(meta.index, meta.nbytes, result)
        if self.stream is None:
            write_tensors(slot.flat, meta.tensors, tensors)
        else:
            # The tensors come from the generator's stream; pack on the side stream once they exist,
            # and keep their memory from being reused until the copies ran.
            self._release_held()
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                write_tensors(slot.flat, meta.tensors, tensors)
                packed = torch.cuda.Event()
                packed.record(self.stream)
            self._held = (tensors, packed)
        return self._flush(slot, meta, result)

    def _release_held(self) -> None:
        """Drop the previous bucket's source tensors. The generator's stream (whose allocator pool
        gets their memory back) first waits for the copies out of them, so nothing allocated there
        later can overwrite a tensor before it was packed."""
        if self._held is not None:
            torch.cuda.current_stream(self.device).wait_event(self._held[1])
            self._held = None

    def _flush(self, slot: _Slot, meta: BucketMeta, result: SendResult) -> torch.Tensor:
        """Send one bucket; returns its checksums (still on the device)."""
        flat = slot.flat[: meta.nbytes]
        with stream_context(self.stream):
            sums = bucket_checksums(meta, flat)
        if self.shared and self.stream is not None:
            self.stream.synchronize()  # colocated receivers read the buffer from another process
        with self._link_errors(f"sending bucket {meta.index}"):
            self.link.control.send((meta, slot.handle if self.shared else None))
            if self.link.data is not None and meta.nbytes:
                with stream_context(self.stream):
                    slot.work = self.link.data.send(self._wire(slot, meta, flat))
        slot.acks_pending = self.shared and meta.nbytes > 0  # receivers ack what they read
        slot.index = meta.index
        result.names.extend(meta.names)
        result.nbytes += meta.nbytes
        result.buckets += 1
        return sums

    def _wire(self, slot: _Slot, meta: BucketMeta, flat: torch.Tensor) -> torch.Tensor:
        """What the data group broadcasts: the bucket, or for engines that take it without padding
        its tight form (a copy only when some tensor is padded; reused with the slot)."""
        if not self.tight:
            return flat
        if slot.tight is None or slot.tight.numel() < tight_nbytes(meta):
            slot.tight = torch.empty(slot.flat.numel(), dtype=torch.uint8, device=self.device)
        return tight_bucket(meta, flat, slot.tight)

    @contextlib.contextmanager
    def _link_errors(self, doing: str):
        """A transport error (a receiver that died or left the group) as one line naming the link."""
        try:
            yield
        except RuntimeError as exc:
            raise ModelUpdateError(
                f"link {self.link.spec.name}: {doing} failed; a receiver of the link died or left its "
                f"group ({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})"
            ) from exc

    def _acquire(self, index: int, need: int, result: SendResult) -> _Slot:
        slot = self.slots[index % 2]
        self._wait_free(slot, result)
        if slot.flat is None or slot.flat.numel() < need:
            if self.stream is not None:
                self.stream.synchronize()
            self._allocate(slot, index % 2, max(need, self.bucket_bytes))
        return slot

    def _allocate(self, slot: _Slot, position: int, nbytes: int) -> None:
        if slot.handle is not None and not slot.released:
            release_shared(slot.handle)
        slot.generation += 1
        if self.shared:
            key = (self.link.spec.name, position, slot.generation)
            slot.flat, slot.handle = allocate_shared(nbytes, self.device, key)
            slot.released = False
        else:
            slot.flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            slot.handle = None

    def _wait_free(self, slot: _Slot, result: SendResult) -> None:
        t0 = time.perf_counter()
        if slot.work is not None:
            with self._link_errors(f"waiting for bucket {slot.index}"), stream_context(self.stream):
                slot.work.wait()
            slot.work = None
        if slot.acks_pending:
            with self._link_errors(f"waiting for the acks of bucket {slot.index}"):
                self.link.control.wait_acks()
            slot.acks_pending = False
            if slot.handle is not None and not slot.released:
                release_shared(slot.handle)  # every colocated receiver has it mapped now
                slot.released = True
        result.wait_s += time.perf_counter() - t0
