"""Receiver side of a link: take each bucket, check it, and hand it to the engine.

Per bucket: the metadata (and, for a colocated receiver, the IPC handle) arrives on the control
channel; a remote receiver then receives the bytes into one of two buffers
(``transport.engine_receive.ReceiveBuffers``: bucket k+1 arrives while bucket k loads); a
colocated one maps the sender's buffer. The bucket is unpacked into views, its checksums are
computed (on the device, read back once at the end) and ``load`` gets the views.

    receiver = BucketReceiver(link, device)
    result = receiver.receive(strategy.load_weights, version=step, lock=threading.Lock())

With ``engine`` given (a strategy whose engine takes buckets in its own processes, e.g. vLLM's TP
workers), a colocated bucket goes to ``engine.load_shared_bucket(meta, handle, verify=True)`` and a
broadcast one to ``engine.receive_bucket(group, meta, verify=True)``, ``group`` being this link's
data group (queued without waiting; the checksums of every broadcast bucket come from
``engine.take_checksums(group)`` after the last one). An engine fed by several trainer ranks has
joined one data group per rank, and each link's buckets go to its own. On a link whose engine built
the data group itself (``LinkSpec.engine_group``, SGLang) a bucket goes to
``engine.update_weights_from_distributed(group, meta)``, which returns once the engine loaded it;
such an engine receives into its own parameters and gives no checksums: the link's
``ReceiveResult.checksums`` is None (the driver's probe checks those weights instead).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from roll.distributed.model_update.errors import ModelUpdateError
from roll.distributed.transport.bucket import BucketMeta, unpack_bucket
from roll.distributed.transport.checksum import bucket_checksums
from roll.distributed.transport.engine_receive import ReceiveBuffers
from roll.distributed.transport.ipc import IpcCache
from roll.distributed.transport.link import Link

LoadFn = Callable[[Iterator[tuple[str, torch.Tensor]]], None]


@dataclass
class ReceiveResult:
    names: list[str] = field(default_factory=list)
    # None: the engine received the link's buckets into its own parameters and cannot checksum them.
    checksums: list[tuple[int, int]] | None = field(default_factory=list)
    nbytes: int = 0
    buckets: int = 0
    # Host time blocked on the control channel, inside ``load``, and in total.
    wait_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    # The weight version the update carried.
    version: int = 0


class BucketReceiver:
    """Receives one update from one link (this member must be one of the link's receivers)."""

    def __init__(self, link: Link, device: torch.device, engine: Any = None):
        if link.is_sender:
            raise ValueError(f"link {link.spec.name}: this member is the sender, not a receiver")
        self.link = link
        self.device = device
        self.engine = engine
        self.cuda = device.type == "cuda"
        self.buffers = ReceiveBuffers(device)
        self.ipc = IpcCache()

    def receive(
        self,
        load: LoadFn,
        version: int,
        lock: threading.Lock | None = None,
        use_engine: bool = True,
    ) -> ReceiveResult:
        """Take one whole update; ``use_engine=False`` passes every bucket to ``load`` even when an
        engine is attached (the verification pass compares instead of loading)."""
        if self.cuda:
            torch.cuda.set_device(self.device)  # receive() may run on a helper thread
        lock = lock or threading.Lock()
        engine = self.engine if use_engine else None
        result = ReceiveResult(version=version)
        sums: list[torch.Tensor | list] = []
        start = time.perf_counter()
        while True:
            meta, handle = self._next_bucket(version, result)
            if meta.nbytes and engine is None:
                sums.append(self._take(meta, handle, load, lock, result))
            elif meta.nbytes:  # the engine takes the bucket in its own processes
                t0 = time.perf_counter()
                with lock:
                    if self.link.is_local:
                        rows = engine.load_shared_bucket(meta, handle, verify=True)
                        sums.append([tuple(row) for row in rows])
                    elif self.link.spec.engine_group:  # returns once the engine has loaded it
                        engine.update_weights_from_distributed(self.link.spec.data_prefix, meta)
                    else:  # queued; its checksums come from take_checksums() after the last bucket
                        engine.receive_bucket(self.link.spec.data_prefix, meta, verify=True)
                result.load_s += time.perf_counter() - t0
                if self.link.is_local:
                    self.link.control.ack()
            result.names.extend(meta.names)
            result.nbytes += meta.nbytes
            result.buckets += 1
            if meta.last:
                break
        sums = self._finish(engine, sums, result)
        result.checksums = None if self._engine_group(engine) else _rows(sums)
        result.total_s = time.perf_counter() - start
        return result

    def _next_bucket(self, version: int, result: ReceiveResult) -> tuple[BucketMeta, Any]:
        """The next bucket's ``(meta, handle)`` from the control channel, checked against ``version``."""
        t0 = time.perf_counter()
        meta, handle = self.link.control.recv()
        result.wait_s += time.perf_counter() - t0
        if meta.version != version:
            raise ModelUpdateError(
                f"link {self.link.spec.name}: bucket {meta.index} carries weight version {meta.version}, "
                f"but this update installs version {version} (sender and receivers were called for different updates)"
            )
        return meta, handle

    def _take(self, meta: BucketMeta, handle, load: LoadFn, lock, result: ReceiveResult) -> torch.Tensor:
        if self.link.is_local:
            flat, work, index = self.ipc.open(handle, self.device)[: meta.nbytes], None, None
        else:
            flat, work = self.buffers.post_recv(meta.index, meta.nbytes, self.link.data)
            index = meta.index
        with self.buffers.reading(index, work):
            bucket_sums = bucket_checksums(meta, flat)
            t0 = time.perf_counter()
            with lock:
                load(iter(unpack_bucket(meta, flat)))
            result.load_s += time.perf_counter() - t0
        if self.link.is_local:
            self.buffers.synchronize()
            self.link.control.ack()
        return bucket_sums

    def _engine_group(self, engine: Any) -> bool:
        """Whether the engine received this link's buckets on a group of its own (no checksums)."""
        return engine is not None and not self.link.is_local and self.link.spec.engine_group

    def _finish(self, engine: Any, sums: list, result: ReceiveResult) -> list:
        """After the last bucket: wait for the loads and the acks; an engine that received the
        broadcast buckets itself gives their checksums now."""
        self.buffers.synchronize()
        if self.link.is_local:
            self.link.control.finish_acks()
        if engine is not None and not self.link.is_local and not self.link.spec.engine_group:
            t0 = time.perf_counter()
            sums = [engine.take_checksums(self.link.spec.data_prefix)]
            result.load_s += time.perf_counter() - t0
        return sums


def _rows(parts: list[torch.Tensor | list]) -> list[tuple[int, int]]:
    """Checksum rows in order; device tensors come back to the host in one transfer."""
    device = [p for p in parts if isinstance(p, torch.Tensor)]
    host = iter(torch.cat(device).cpu().tolist()) if device else iter(())
    rows: list[tuple[int, int]] = []
    for part in parts:
        if isinstance(part, torch.Tensor):
            rows.extend(tuple(next(host)) for _ in range(part.shape[0]))
        else:
            rows.extend(part)
    return rows


def receive_links(
    receivers: list[BucketReceiver],
    load: LoadFn,
    version: int,
    use_engine: bool = True,
) -> list[ReceiveResult]:
    """Receive one update from every link at once (one thread per link, loads serialized).

    Links are served concurrently because the senders are: a trainer rank blocked on a slow link
    could otherwise hold up a collective that another sender's weight generator needs.
    """
    if len(receivers) == 1:
        return [receivers[0].receive(load, version, None, use_engine)]
    lock = threading.Lock()
    results: list[ReceiveResult | BaseException | None] = [None] * len(receivers)

    def run(i: int) -> None:
        try:
            results[i] = receivers[i].receive(load, version, lock, use_engine)
        except BaseException as exc:  # noqa: BLE001 - re-raised below on the caller's thread
            results[i] = exc

    threads = [
        threading.Thread(target=run, args=(i,), name=f"model-update-recv-{i}") for i in range(len(receivers))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
