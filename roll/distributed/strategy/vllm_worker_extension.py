"""Methods mixed into vLLM's GPU workers (``worker_extension_cls``) to receive model updates.

vLLM builds its worker class with this class as an extra base, so the methods run inside every
tensor-parallel worker process with the worker's ``self.device``, ``self.rank`` and
``self.model_runner`` at hand. ``VLLMStrategy`` reaches them with ``llm.collective_rpc(name, ...)``;
every worker runs the call and the strategy gets one result per worker.

Buckets are those of ``roll.distributed.transport.bucket`` (HF names, 256-byte aligned flat
uint8 buffers) and arrive one of two ways, both built from the model-update package's own pieces
so the two ends of a link are constructed alike:

* broadcast: each worker joins the sender's group (``open_store`` + ``new_group``, rank
  ``rank_offset + worker rank``) and receives every bucket into one of two buffers it keeps
  between buckets. Nothing waits on the host: the receive is posted on a side stream (behind the
  last load that read that buffer), the checksums and the load are queued behind the receive, so
  bucket k+1 arrives while bucket k loads; ``roll_take_checksums`` waits once at the end;
* shared memory (colocated): each worker maps the sender's buffer from its handle (``IpcCache``).

Either way the tensors are views into the flat buffer, loaded with the model's own
``load_weights`` (which shards them for tensor parallelism), and optionally checksummed.
"""

from __future__ import annotations

from typing import Any

import torch


class RollWorkerExtension:
    """vLLM worker mix-in (names start with ``roll_`` to stay clear of vLLM's own methods)."""

    def roll_init_update_group(
        self, host: str, port: int, prefix: str, rank_offset: int, world_size: int, backend: str = "nccl"
    ) -> int:
        """Join the sender's broadcast group; returns this worker's rank in it."""
        from roll.distributed.transport.broadcast import BroadcastTransport
        from roll.distributed.transport.process_group import new_group, open_store

        rank = rank_offset + int(self.rank)
        store = open_store(host, port, world_size, is_master=False)
        group = new_group(backend, store, prefix, rank, world_size)
        self._roll_transport = BroadcastTransport(group, rank)
        self._roll_group = group
        self._roll_pipe = _ReceivePipeline(torch.device(self.device))
        return rank

    def roll_destroy_update_group(self) -> None:
        self._roll_transport = None
        self._roll_group = None
        self._roll_pipe = None

    def roll_receive_bucket(self, meta: Any, verify: bool = False) -> None:
        """Receive one broadcast bucket and load it, queued on the device without waiting; its
        per-tensor checksums (when ``verify``) come back from ``roll_take_checksums``."""
        transport = getattr(self, "_roll_transport", None)
        if transport is None:
            raise RuntimeError("roll_receive_bucket before roll_init_update_group")
        pipe = self._roll_pipe
        flat, work = pipe.post_recv(meta.index, meta.nbytes, transport)
        with pipe.work():
            work.wait()
            if verify:
                pipe.sums.append(_bucket_sums(meta, flat))
            self._roll_model().load_weights(weights=_views(meta, flat, self.device))
            pipe.release(meta.index)

    def roll_take_checksums(self) -> list[tuple[int, int]]:
        """Wait for every queued bucket; their checksums in order (then forgotten)."""
        pipe = getattr(self, "_roll_pipe", None)
        if pipe is None:
            return []
        self._roll_sync()
        return pipe.take_sums()

    def roll_load_shared_bucket(
        self, meta: Any, handle: Any, device_index: int | None = None, verify: bool = False
    ) -> list[tuple[int, int]] | None:
        """Map the sender's buffer (``handle`` from ``ipc.allocate_shared``) and load the bucket.

        ``device_index`` is where the buffer lives in this process's numbering of the visible
        devices (the strategy's own device); None means this worker's device.
        """
        from roll.distributed.transport.ipc import IpcCache

        cache = getattr(self, "_roll_ipc", None)
        if cache is None:
            cache = self._roll_ipc = IpcCache()
        if handle.kind == "cuda":
            device = self.device if device_index is None else torch.device("cuda", device_index)
        else:
            device = torch.device("cpu")
        flat = cache.open(handle, device)[: meta.nbytes]
        return self._roll_load_flat(meta, flat, verify)

    def roll_load_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load full HF-named tensors given by value (the slow, general path); returns the count."""
        self._roll_model().load_weights(weights=[(name, t.to(self.device)) for name, t in named_tensors])
        self._roll_sync()
        return len(named_tensors)

    def roll_finish_update(self, version: int) -> int:
        """End of one update: record the weight version this worker now holds."""
        self._roll_version = version
        return version

    def roll_weight_version(self) -> int | None:
        return getattr(self, "_roll_version", None)

    # ------------------------------------------------------------------------------ helpers
    def _roll_load_flat(self, meta: Any, flat: torch.Tensor, verify: bool) -> list[tuple[int, int]] | None:
        from roll.distributed.transport.checksum import bucket_checksums

        sums = [tuple(s) for s in bucket_checksums(meta, flat).tolist()] if verify else None
        self._roll_model().load_weights(weights=_views(meta, flat, self.device))
        self._roll_sync()
        return sums

    def _roll_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def _roll_sync(self) -> None:
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)  # every stream, the pipeline's included


def _views(meta: Any, flat: torch.Tensor, device: Any) -> list[tuple[str, torch.Tensor]]:
    from roll.distributed.transport.bucket import unpack_bucket

    return [(name, t.to(device)) for name, t in unpack_bucket(meta, flat)]


def _bucket_sums(meta: Any, flat: torch.Tensor) -> torch.Tensor:
    from roll.distributed.transport.checksum import bucket_checksums

    return bucket_checksums(meta, flat)


class _ReceivePipeline:
    """Two receive buffers on ``device`` and the streams that let bucket k+1 arrive while k loads.

    A buffer is reused only after the load that read it (its ``free`` event); on CPU everything
    runs in order on the calling thread.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.flats: list[torch.Tensor | None] = [None, None]
        self.free = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.recv_stream = torch.cuda.Stream(device) if self.cuda else None
        self.work_stream = torch.cuda.Stream(device) if self.cuda else None
        self.sums: list[torch.Tensor] = []

    def post_recv(self, index: int, nbytes: int, transport: Any) -> tuple[torch.Tensor, Any]:
        slot = index % 2
        flat = self.flats[slot]
        if flat is None or flat.numel() < nbytes:
            if self.cuda:
                torch.cuda.synchronize(self.device)  # the old buffer may still be read by a load
            flat = self.flats[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if not self.cuda:
            return flat[:nbytes], transport.recv(flat[:nbytes])
        with torch.cuda.stream(self.recv_stream):
            self.recv_stream.wait_event(self.free[slot])
            return flat[:nbytes], transport.recv(flat[:nbytes])

    def work(self):
        import contextlib

        return torch.cuda.stream(self.work_stream) if self.cuda else contextlib.nullcontext()

    def release(self, index: int) -> None:
        if self.cuda:
            self.free[index % 2].record(self.work_stream)

    def take_sums(self) -> list[tuple[int, int]]:
        if not self.sums:
            return []
        rows = [tuple(row) for row in torch.cat(self.sums).cpu().tolist()]
        self.sums = []
        return rows
