"""Methods mixed into vLLM's GPU workers (``worker_extension_cls``) to receive model updates.

vLLM builds its worker class with this class as an extra base, so the methods run inside every
tensor-parallel worker process with the worker's ``self.device``, ``self.rank`` and
``self.model_runner`` at hand. ``VLLMStrategy`` reaches them through ``VLLMWorkerCalls.call``
(below), one ``llm.collective_rpc`` each; every worker runs the call and the strategy gets one
result per worker. vLLM finds a worker method only by name, so the caller names its target by
reference to the ``RollWorkerExtension`` method (a reader and a type checker follow the call into
the worker, arguments included) and ``call`` takes the name vLLM needs from that reference::

    workers = VLLMWorkerCalls(llm)
    workers.call(RollWorkerExtension.roll_load_shared_bucket, meta, handle, 0, True)  # one result per TP worker

Receiving is ``roll.distributed.transport.engine_receive.EngineReceiver``'s, the same as SGLang's:
a broadcast bucket lands in its double buffer (bucket k+1 arrives while k loads, nothing waits on
the host until ``roll_take_checksums``), a colocated one is mapped from the sender's buffer. Either
way the tensors are views into the flat buffer, handed on this worker's device to the model's own
``load_weights`` (which shards them for tensor parallelism), and optionally checksummed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from roll.distributed.strategy.vllm_omni_positions import fix_qwen3_omni_positions
from roll.distributed.transport.engine_receive import EngineReceiver

P = ParamSpec("P")
R = TypeVar("R")


class RollWorkerExtension:
    """vLLM worker mix-in (names start with ``roll_`` to stay clear of vLLM's own methods)."""

    def roll_init_update_group(
        self, host: str, port: int, prefix: str, rank_offset: int, world_size: int, backend: str = "nccl"
    ) -> int:
        """Join the sender's broadcast group; returns this worker's rank in it."""
        rank = rank_offset + int(self.rank)
        self._roll_receiver().join(host, port, prefix, rank, world_size, backend)
        return rank

    def roll_destroy_update_group(self) -> None:
        self._roll_receiver().leave()

    def roll_receive_bucket(self, group: str, meta: Any, verify: bool = False) -> None:
        """Receive one bucket broadcast on ``group`` and load it, queued on the device without
        waiting; its per-tensor checksums (when ``verify``) come back from ``roll_take_checksums``."""
        self._roll_receiver().receive(group, meta, verify)

    def roll_take_checksums(self, group: str) -> list[tuple[int, int]]:
        """Wait for every bucket queued on ``group``; their checksums in order (then forgotten)."""
        return self._roll_receiver().take_checksums(group)

    def roll_load_shared_bucket(
        self, meta: Any, handle: Any, device_index: int | None = None, verify: bool = False
    ) -> list[tuple[int, int]] | None:
        """Map the sender's buffer (``handle`` from ``ipc.allocate_shared``) and load the bucket.

        ``device_index`` is where the buffer lives in this process's numbering of the visible
        devices (the strategy's own device); None means this worker's device.
        """
        device = None if device_index is None else torch.device("cuda", device_index)
        return self._roll_receiver().load_shared(meta, handle, device, verify)

    def roll_load_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load full HF-named tensors given by value (the slow, general path); returns the count."""
        self._roll_receiver().load_tensors(named_tensors)
        return len(named_tensors)

    def roll_finish_update(self, version: int) -> int:
        """End of one update: record the weight version this worker now holds."""
        self._roll_version = version
        return version

    def roll_weight_version(self) -> int | None:
        return getattr(self, "_roll_version", None)

    def roll_fix_mrope_positions(self) -> str:
        """Qwen3-Omni's image positions as transformers lays them (``vllm_omni_positions``): what
        was done ("fixed", "correct", "not qwen3-omni")."""
        return fix_qwen3_omni_positions(self.model_runner.get_model())

    def roll_manual_seed(self, seed: int) -> int:
        """Seed this worker's torch generators: vLLM samples unseeded requests from them."""
        torch.manual_seed(seed)
        return seed

    # ------------------------------------------------------------------------------ helpers
    def _roll_receiver(self) -> EngineReceiver:
        """This worker's receiver (made on first use): it hands the tensors, on this worker's
        device, to the model's ``load_weights``, looked up at each load (the model object is
        vLLM's to keep or replace)."""
        receiver = getattr(self, "_roll_engine_receiver", None)
        if receiver is None:
            receiver = self._roll_engine_receiver = EngineReceiver(
                torch.device(self.device), lambda named: self.model_runner.model.load_weights(named)
            )
        return receiver


class VLLMWorkerCalls:
    """Runs a ``RollWorkerExtension`` method in every TP worker of ``llm``; results in rank order.

    ``serialize``: one call at a time. vLLM's multiprocess executor (TP > 1) writes every call into
    one shared-memory queue and reads the replies back without a lock, so two threads calling at
    once (a model update receives from several trainer ranks on threads of its own) can corrupt the
    queue; the in-process executor (TP = 1) calls the worker directly and needs no lock.
    """

    def __init__(self, llm: Any, serialize: bool = False) -> None:
        self.llm = llm
        self._one_at_a_time = threading.Lock() if serialize else contextlib.nullcontext()

    def call(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """``method`` (a ``RollWorkerExtension`` method, named by reference) on every TP worker:
        the one place it becomes the name vLLM looks it up by."""
        with self._one_at_a_time:
            return self.llm.collective_rpc(method.__name__, args=args, kwargs=kwargs or None)
