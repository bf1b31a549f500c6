"""The engine's end of a model update: buckets in, HF-named tensors handed to the engine's loader.

vLLM's TP workers (``strategy/vllm_worker_extension.py``) and SGLang's worker
(``strategy/sglang_strategy.py``) receive alike through ``EngineReceiver``; they differ only in
``load``, the one engine call that takes a list of full HF-named tensors (vLLM's
``model.load_weights``, SGLang's ``Engine.update_weights_from_tensor``). A bucket arrives one of
two ways:

* broadcast: ``join`` the sender's group, then ``receive(group, meta)`` each bucket into that
  group's double buffer (``ReceiveBuffers``, queued on the device: bucket k+1 arrives while k
  loads) and ``take_checksums(group)`` after the last one. An engine joins one group per trainer
  rank that broadcasts to it (a DP or PP trainer over several devices feeds each engine from
  several ranks), each named by its ``prefix``;
* colocated: ``load_shared(meta, handle)`` maps the sender's buffer (``ipc``) and loads from it.

Either way ``load`` gets views into the flat buffer (moved to the receiver's device when the buffer
lies on another one), so no bucket is unpacked twice::

    receiver = EngineReceiver(device, load=model.load_weights)
    receiver.join(host, port, "link0/data", rank=1, world_size=3, backend="nccl")
    for meta in metas:
        receiver.receive("link0/data", meta, verify=True)
    sums = receiver.take_checksums("link0/data")

An engine that passes the tensors on to other processes by CUDA IPC (SGLang's schedulers, vLLM's
TP workers from ``VLLMStrategy.load_weights``) needs them in memory this process allocated:
``shareable_tensors`` / ``shareable_bucket`` hand them over as they are when they are, and copy
them into one fresh buffer when not (``reshare=True`` does that for a mapped colocated buffer).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from roll.distributed.transport.broadcast import BroadcastTransport
from roll.distributed.transport.bucket import BucketMeta, TensorMeta, pack_bucket, unpack_bucket
from roll.distributed.transport.checksum import bucket_checksums
from roll.distributed.transport.ipc import IpcCache, IpcHandle
from roll.distributed.transport.process_group import new_group, open_store

Named = list[tuple[str, torch.Tensor]]
LoadFn = Callable[[Named], None]


class ReceiveBuffers:
    """The receiving end's double buffer: two flat buffers on ``device``, taken by bucket index.

    On GPU the receive into a buffer is posted on a side stream that waits only for the last load
    that read that buffer (its ``free`` event), and the load runs on a second side stream behind
    the receive, so the host never waits between buckets. On CPU everything runs in order on the
    calling thread. ``EngineReceiver`` and ``model_update.receiver.BucketReceiver`` (a worker that
    receives buckets itself) both use it::

        flat, work = buffers.post_recv(meta.index, meta.nbytes, transport)
        with buffers.reading(meta.index, work):       # on the work stream, once the bytes are there
            load(unpack_bucket(meta, flat))
        buffers.synchronize()                         # after the last bucket
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.flats: list[torch.Tensor | None] = [None, None]
        self.free = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.recv_stream = torch.cuda.Stream(device) if self.cuda else None
        self.work_stream = torch.cuda.Stream(device) if self.cuda else None

    def post_recv(self, index: int, nbytes: int, transport: Any) -> tuple[torch.Tensor, Any]:
        """Post the receive of bucket ``index`` (``nbytes``) from ``transport`` into its buffer;
        returns the buffer's first ``nbytes`` and the receive's ``Work``."""
        slot = index % 2
        flat = self.flats[slot]
        if flat is None or flat.numel() < nbytes:
            self.synchronize()  # the old buffer may still be read by a load
            flat = self.flats[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        flat = flat[:nbytes]
        if not self.cuda:
            return flat, transport.recv(flat)
        with torch.cuda.stream(self.recv_stream):
            self.recv_stream.wait_event(self.free[slot])
            return flat, transport.recv(flat)

    @contextlib.contextmanager
    def reading(self, index: int | None, work: Any = None) -> Iterator[None]:
        """Run the block on the work stream once ``work`` (a receive) is done; then bucket
        ``index``'s buffer may take the next receive (``None``: no buffer of ours was read)."""
        with torch.cuda.stream(self.work_stream) if self.cuda else contextlib.nullcontext():
            if work is not None:
                work.wait()
            yield
            if index is not None and self.cuda:
                self.free[index % 2].record(self.work_stream)

    def synchronize(self) -> None:
        """Wait for every load queued on the work stream."""
        if self.work_stream is not None:
            self.work_stream.synchronize()


class _Incoming:
    """One broadcast group this engine receives from: its transport, double buffer and the
    checksums of the buckets queued since the last ``take_checksums``."""

    def __init__(self, transport: BroadcastTransport, device: torch.device) -> None:
        self.transport = transport
        self.buffers = ReceiveBuffers(device)
        self.sums: list[torch.Tensor] = []


class EngineReceiver:
    """Receives buckets for one engine process and hands each to ``load`` (see the module docstring).

    ``reshare``: ``load`` passes the tensors on by CUDA IPC, so a colocated sender's mapped buffer
    (which torch refuses to share again) is copied into one of this process's own first.
    """

    def __init__(self, device: torch.device | str, load: LoadFn, reshare: bool = False) -> None:
        self.device = torch.device(device)
        self.load = load
        self.reshare = reshare
        self.ipc = IpcCache()
        # Broadcast groups joined, by prefix: one per trainer rank that sends to this engine.
        self.groups: dict[str, _Incoming] = {}

    # ------------------------------------------------------------------------------ broadcast
    def join(self, host: str, port: int, prefix: str, rank: int, world_size: int, backend: str) -> None:
        """Join the sender's broadcast group ``prefix`` (its store at host:port) as ``rank``."""
        store = open_store(host, port, world_size, is_master=False)
        transport = BroadcastTransport(new_group(backend, store, prefix, rank, world_size), rank)
        self.groups[prefix] = _Incoming(transport, self.device)

    def leave(self) -> None:
        self.groups = {}

    def receive(self, group: str, meta: BucketMeta, verify: bool = False) -> None:
        """Receive the next bucket broadcast on ``group`` and load it, queued on the device without
        waiting; its per-tensor checksums (when ``verify``) come back from ``take_checksums``."""
        incoming = self.groups.get(group)
        if incoming is None:
            joined = ", ".join(sorted(self.groups)) or "none"
            raise RuntimeError(
                f"a bucket arrived on broadcast group {group!r}, which this engine has not joined (joined: {joined})"
            )
        flat, work = incoming.buffers.post_recv(meta.index, meta.nbytes, incoming.transport)
        with incoming.buffers.reading(meta.index, work):
            if verify:
                incoming.sums.append(bucket_checksums(meta, flat))
            self.load(self._on_device(unpack_bucket(meta, flat)))

    def take_checksums(self, group: str) -> list[tuple[int, int]]:
        """Wait for every bucket queued on ``group``; their checksums in order (then forgotten)."""
        incoming = self.groups.get(group)
        if incoming is None:
            return []
        self.synchronize()
        sums, incoming.sums = incoming.sums, []
        return [tuple(row) for row in torch.cat(sums).cpu().tolist()] if sums else []

    # ------------------------------------------------------------------------------ colocated
    def load_shared(
        self, meta: BucketMeta, handle: IpcHandle, device: torch.device | None = None, verify: bool = False
    ) -> list[tuple[int, int]] | None:
        """Map the sender's buffer (``handle`` from ``ipc.allocate_shared``) and load the bucket.
        ``device`` is where a CUDA buffer lives in this process's numbering (default: ours)."""
        where = (device or self.device) if handle.kind == "cuda" else torch.device("cpu")
        flat = self.ipc.open(handle, where)[: meta.nbytes]
        sums = [tuple(s) for s in bucket_checksums(meta, flat).tolist()] if verify else None
        if self.reshare and flat.is_cuda:
            flat = flat.clone()  # a mapped buffer cannot be shared again; our own copy can
            torch.cuda.current_stream(flat.device).synchronize()
        self.load(self._on_device(unpack_bucket(meta, flat)))
        self.synchronize()
        return sums

    # ------------------------------------------------------------------------------ by value
    def load_tensors(self, named: Named) -> None:
        """Load full tensors given by value (on any device) and wait for the load."""
        self.load(self._on_device(named))
        self.synchronize()

    def _on_device(self, named: Named) -> Named:
        """The tensors on this receiver's device (as they are when they already lie there)."""
        return [(name, tensor.to(self.device)) for name, tensor in named]

    def synchronize(self) -> None:
        """Wait for every stream of this device (the receive buffers' included)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# -------------------------------------------------------------------- tensors other processes map


def bucket_over_storage(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[BucketMeta, torch.Tensor] | None:
    """``(BucketMeta, flat)`` describing tensors that are contiguous views into one storage (a
    receiver's bucket buffer) without copying them, or None when they are not."""
    if not named:
        return None
    storage = named[0][1].untyped_storage()
    metas = []
    for name, tensor in named:
        if not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        offset = tensor.storage_offset() * tensor.element_size()
        metas.append(
            TensorMeta(
                name, tensor.dtype, tuple(tensor.shape), offset, tensor.numel() * tensor.element_size()
            )
        )
    flat = torch.empty(0, dtype=torch.uint8, device=named[0][1].device)
    flat.set_(storage, 0, (storage.nbytes(),))
    return BucketMeta(metas, storage.nbytes(), version=-1, index=0, last=True), flat


def shareable_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[BucketMeta, torch.Tensor, IpcHandle]:
    """``(meta, flat, handle)``: CUDA tensors as one bucket that engine processes can map by CUDA IPC.

    Views into one buffer this process allocated are shared as they are. Anything else -- scattered
    tensors, or a buffer this process itself mapped from another one (torch refuses to share those
    again) -- is packed into a fresh buffer first.
    """
    torch.cuda.current_stream(named[0][1].device).synchronize()  # the bytes must be there first
    view = bucket_over_storage(named)
    handle = _cuda_ipc_handle(view[1]) if view is not None else None
    if view is not None and handle is not None:
        return (*view, handle)
    meta, flat = _packed(named)
    return meta, flat, _cuda_ipc_handle(flat)


def shareable_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> Named:
    """CUDA tensors that another process can map by CUDA IPC. As in ``shareable_bucket``, views
    into one buffer of ours are handed over as they are; anything else is packed into a fresh buffer
    (which the returned views keep alive)."""
    torch.cuda.current_stream(named[0][1].device).synchronize()
    view = bucket_over_storage(named)
    if view is not None and _cuda_ipc_handle(view[1]) is not None:
        return list(named)
    return unpack_bucket(*_packed(named))


def _packed(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[BucketMeta, torch.Tensor]:
    meta, flat = pack_bucket(list(named), version=-1, index=0, last=True)
    torch.cuda.current_stream(flat.device).synchronize()
    return meta, flat


def _cuda_ipc_handle(flat: torch.Tensor) -> IpcHandle | None:
    """The handle of a buffer this process allocated; None for one it mapped from another process
    (torch: "Attempted to send CUDA tensor received from another process")."""
    try:
        _, args = reduce_tensor(flat)
    except RuntimeError:
        return None
    return IpcHandle("cuda", ("roll-engine-load", uuid.uuid4().hex), flat.numel(), tuple(args))
