"""Methods mixed into vLLM's GPU workers (``worker_extension_cls``) to receive model updates.

vLLM builds its worker class with this class as an extra base, so the methods run inside every
tensor-parallel worker process with the worker's ``self.device``, ``self.rank`` and
``self.model_runner`` at hand. ``VLLMStrategy`` reaches them with ``llm.collective_rpc(name, ...)``;
every worker runs the call and the strategy gets one result per worker.

Buckets are those of ``roll.distributed.model_update.bucket`` (HF names, 256-byte aligned flat
uint8 buffers) and arrive one of two ways, both built from the model-update package's own pieces
so the two ends of a link are constructed alike:

* broadcast: each worker joins the sender's group (``open_store`` + ``new_group``, rank
  ``rank_offset + worker rank``) and receives every bucket into a buffer it keeps between buckets;
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
        from roll.distributed.model_update.broadcast import BroadcastTransport
        from roll.distributed.model_update.process_group import new_group, open_store

        rank = rank_offset + int(self.rank)
        store = open_store(host, port, world_size, is_master=False)
        group = new_group(backend, store, prefix, rank, world_size)
        self._roll_transport = BroadcastTransport(group, rank)
        self._roll_group = group
        self._roll_buffer: torch.Tensor | None = None
        return rank

    def roll_destroy_update_group(self) -> None:
        self._roll_transport = None
        self._roll_group = None
        self._roll_buffer = None

    def roll_receive_bucket(self, meta: Any, verify: bool = False) -> list[tuple[int, int]] | None:
        """Receive one broadcast bucket and load it; returns per-tensor checksums when ``verify``."""
        transport = getattr(self, "_roll_transport", None)
        if transport is None:
            raise RuntimeError("roll_receive_bucket before roll_init_update_group")
        buffer = self._roll_buffer
        if buffer is None or buffer.numel() < meta.nbytes:
            buffer = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
            self._roll_buffer = buffer
        flat = buffer[: meta.nbytes]
        transport.recv(flat).wait()
        return self._roll_load_flat(meta, flat, verify)

    def roll_load_shared_bucket(
        self, meta: Any, handle: Any, device_index: int | None = None, verify: bool = False
    ) -> list[tuple[int, int]] | None:
        """Map the sender's buffer (``handle`` from ``ipc.allocate_shared``) and load the bucket.

        ``device_index`` is where the buffer lives in this process's numbering of the visible
        devices (the strategy's own device); None means this worker's device.
        """
        from roll.distributed.model_update.ipc import IpcCache

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
        from roll.distributed.model_update.bucket import unpack_bucket
        from roll.distributed.model_update.checksum import bucket_checksums

        sums = [tuple(s) for s in bucket_checksums(meta, flat).tolist()] if verify else None
        weights = [(name, t.to(self.device)) for name, t in unpack_bucket(meta, flat)]
        self._roll_model().load_weights(weights=weights)
        self._roll_sync()
        return sums

    def _roll_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def _roll_sync(self) -> None:
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
