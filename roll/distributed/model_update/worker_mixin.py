"""Worker methods of the model update, mixed into the role workers (subclasses of ``Worker``).

``ModelUpdateGroup`` (driver side) calls them through the clusters; nothing else needs to. A worker
class that trains mixes in the sender, one that serves generation the receiver; ``ModelWorker``
serves every model role, so it takes both::

    class ModelWorker(ModelUpdateSenderMixin, ModelUpdateReceiverMixin, Worker): ...

Sender (trainer rank): ``model_update_send`` iterates ``self.strategy.iter_hf_weights()`` on every
rank (it may be collective) and streams what this rank yields into its link; it returns the
``SendResult``.

Receiver (engine worker): ``model_update_receive`` takes one update from every link and loads each
bucket with ``self.strategy.load_weights`` (or the engine's own bucket calls, see below), then calls
``strategy.finish_model_update(version)`` when the strategy is a ``FinishesModelUpdate`` and
records ``weight_version``; it returns one ``ReceiveResult`` per link. The whole update runs inside
one actor call, and Ray runs one call at a time per worker, so a ``generate`` on the same worker
runs wholly before or wholly after it: no request sees a half-updated model.

Engines that receive buckets in their own processes implement the Protocols of
``roll/distributed/strategy/base.py``: ``SharedBucketEngine`` (a colocated sender's buffer),
``BroadcastBucketEngine`` (vLLM's TP workers join the broadcast group) and
``DistributedBucketEngine`` (SGLang's schedulers build the group themselves, on the links the
strategy's ``uses_engine_group`` takes); the receiver uses them when the strategy implements them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from roll.core.batch import Batch
from roll.distributed.executor.dispatch import Dispatch, register
from roll.distributed.model_update.errors import ModelUpdateError
from roll.distributed.model_update.receiver import BucketReceiver, ReceiveResult, receive_links
from roll.distributed.model_update.sender import BucketSender, SendResult
from roll.distributed.strategy.base import (
    BroadcastBucketEngine,
    DistributedBucketEngine,
    FinishesModelUpdate,
    HFWeightSource,
    SharedBucketEngine,
)
from roll.distributed.transport.link import Link, LinkSpec
from roll.utils.ports import free_port


@dataclass(frozen=True)
class DeviceInfo:
    """Where a worker's devices are (``model_update_device_info``); ``plan_links`` pairs them."""

    rank: int
    device_ids: list[int]  # global device ids (``ROLL_DEVICE_IDS``)
    node_ip: str
    cuda: bool
    data_ranks: int  # ranks the worker adds to a broadcast group (its engine's TP workers)
    engine_group: bool = False  # links from other devices come through the engine's own group


@dataclass(frozen=True)
class VerifyResult:
    """What one engine worker found comparing a repeated update with its weights."""

    first_mismatch: str | None  # the first tensor that differs, in link order
    difference: str  # how it differs (``describe_difference``)
    mismatches: int
    exposes_weights: bool
    missing: list[str] = field(default_factory=list)


class _ModelUpdateWorker:
    """What both ends need: where this worker's devices are, its weight version, the probe."""

    weight_version: int | None = None

    @register(Dispatch.ONE_TO_ALL)
    def model_update_device_info(self) -> DeviceInfo:
        """Global device ids (``ROLL_DEVICE_IDS``), node IP, device kind and broadcast ranks needed."""
        ids = os.environ.get("ROLL_DEVICE_IDS", "")
        device_ids = [int(d) for d in ids.split(",") if d != ""]
        return device_info(
            self.strategy, self.rank, device_ids, ray.util.get_node_ip_address(), self.ctx.is_cuda
        )

    @register(Dispatch.ONE_TO_ALL)
    def model_update_version(self) -> int | None:
        return self.weight_version

    @register(Dispatch.ONE_TO_ALL)
    def model_update_probe_log_probs(self, batch: Batch) -> torch.Tensor | None:
        """Log-probs [B, R] of the probe batch on CPU from an output rank (None elsewhere). Every
        rank must take part: the forward may be collective (FSDP gathers, Megatron TP/PP)."""
        out = self.strategy.compute_log_probs(batch)["log_probs"]
        return out.float().cpu() if self.strategy.dp_layout()[2] else None


class ModelUpdateSenderMixin(_ModelUpdateWorker):
    """Trainer side: one link per rank, this rank its sender."""

    @register(Dispatch.ONE_TO_ALL)
    def model_update_open_port(self) -> tuple[str, int]:
        """Where this rank will host its link's rendezvous store."""
        return ray.util.get_node_ip_address(), free_port()

    @register(Dispatch.ONE_TO_ALL)
    def model_update_connect_sender(self, group: str, specs: list[LinkSpec], bucket_bytes: int) -> None:
        """Join this rank's link of ``group`` (``specs[rank]``); all members of a link join together.
        A trainer may feed several inference roles: one group each."""
        link = Link.connect(specs[self.rank], "sender", self.ctx.device)
        senders = self.__dict__.setdefault("_model_update_senders", {})
        senders[group] = BucketSender(link, self.ctx.device, bucket_bytes)

    @register(Dispatch.ONE_TO_ALL)
    def model_update_send(self, group: str, version: int) -> SendResult:
        """Send this rank's share of the weights over ``group`` as ``version``; names, checksums, timings."""
        sender = self.__dict__.get("_model_update_senders", {}).get(group)
        if sender is None:
            raise ModelUpdateError(
                f"{self.role} rank {self.rank}: model_update_send({group!r}) before model_update_connect_sender"
            )
        result = sender.send(self.strategy.iter_hf_weights(), version)
        self.weight_version = version
        return result


class ModelUpdateReceiverMixin(_ModelUpdateWorker):
    """Engine side: one receiver per trainer rank's link."""

    @register(Dispatch.ONE_TO_ALL)
    def model_update_connect_receiver(self, group: str, specs: list[LinkSpec]) -> None:
        """Join every link of ``group`` (in order, so all members meet in the same order)."""
        own = self.model_update_device_info().device_ids
        receivers = []
        for spec in specs:
            device = self._link_device(spec, own)
            engine = self.strategy if _engine_receives(self.strategy, spec, self.rank) else None
            join = _engine_join(engine, spec, self.rank) if engine is not None else None
            link = Link.connect(spec, self.rank, device, join_data=join)
            receivers.append(BucketReceiver(link, device, engine=engine))
        self.__dict__.setdefault("_model_update_receivers", {})[group] = receivers

    @register(Dispatch.ONE_TO_ALL)
    def model_update_receive(self, group: str, version: int) -> list[ReceiveResult]:
        """Apply one whole update (every link of ``group``), then record ``version``; one result
        (names, checksums, timings) per link, in link order."""
        results = receive_links(self._receivers(group), self.strategy.load_weights, version)
        if isinstance(self.strategy, FinishesModelUpdate):
            self.strategy.finish_model_update(version)
        self.weight_version = version
        return results

    @register(Dispatch.ONE_TO_ALL)
    def model_update_verify(self, group: str, version: int) -> VerifyResult:
        """Receive a repeated update without loading it and compare every tensor with the engine's
        own (cast to the engine's dtype): the first tensor that differs, per link order."""
        engine = _engine_hf_weights(self.strategy)
        mismatches: dict[str, str] = {}
        missing: list[str] = []
        lock = threading.Lock()

        def compare(named: Iterator[tuple[str, torch.Tensor]]) -> None:
            for name, received in named:
                have = engine.get(name) if engine is not None else None
                if have is None:
                    missing.append(name)
                    continue
                want = received.to(device=have.device, dtype=have.dtype)
                if not torch.equal(want, have):
                    with lock:
                        mismatches[name] = describe_difference(want, have)

        results = receive_links(self._receivers(group), compare, version, use_engine=False)
        order = [name for r in results for name in r.names]
        first = min(mismatches, key=order.index) if mismatches else None
        return VerifyResult(
            first, mismatches.get(first, ""), len(mismatches), engine is not None, missing[:5]
        )

    @register(Dispatch.ONE_TO_ALL)
    def model_update_can_verify(self, group: str) -> bool:
        """Whether ``model_update_verify`` works here: this process receives every bucket itself and
        the engine shows its weights by HF name."""
        if any(r.engine is not None for r in self._receivers(group)):
            return False
        return isinstance(self.strategy, HFWeightSource)

    # ------------------------------------------------------------------------------ helpers
    def _receivers(self, group: str) -> list[BucketReceiver]:
        receivers = self.__dict__.get("_model_update_receivers", {}).get(group)
        if receivers is None:
            raise ModelUpdateError(
                f"{self.role} rank {self.rank}: model update of {group!r} before model_update_connect_receiver"
            )
        return receivers

    def _link_device(self, spec: LinkSpec, own_ids: list[int]) -> torch.device:
        """This worker's device; for a colocated link, the local index of the sender's device."""
        if not self.ctx.is_cuda or not spec.is_local(self.rank) or spec.sender_device not in own_ids:
            return self.ctx.device
        return torch.device("cuda", own_ids.index(spec.sender_device))


def describe_difference(want: torch.Tensor, have: torch.Tensor) -> str:
    """How the engine's tensor ``have`` differs from the trainer's ``want`` (same shape and dtype):
    how many elements, where the first one is, the largest gap, and any NaN/inf the engine holds."""
    if want.shape != have.shape:
        return f"shape {tuple(have.shape)} instead of {tuple(want.shape)}"
    differ = (want != have).reshape(-1)
    count = int(differ.sum())
    first = int(differ.nonzero()[0]) if count else -1
    gap = (want.float() - have.float()).abs().reshape(-1)[differ]
    finite_gap = gap[torch.isfinite(gap)]
    largest = f"{float(finite_gap.max()):.3g}" if finite_gap.numel() else "inf"
    bad = int((~torch.isfinite(have.float())).sum())
    return (
        f"{count} of {want.numel()} elements differ, the first at flat index {first}, largest "
        f"|difference| {largest}; the engine's copy holds {bad} non-finite value(s)"
    )


def device_info(strategy: Any, rank: int, device_ids: list[int], node_ip: str, cuda: bool) -> DeviceInfo:
    """A worker's ``DeviceInfo``: an engine that receives in its own processes (roll's group or, on
    links from other devices, its own) adds one rank per TP process to a broadcast group."""
    engine_group = _engine_group(strategy, colocated=False)
    in_engine = isinstance(strategy, BroadcastBucketEngine) or engine_group
    ranks = strategy.model_update_ranks() if in_engine else 1
    return DeviceInfo(rank, device_ids, node_ip, cuda, int(ranks), engine_group)


def _engine_group(strategy: Any, colocated: bool) -> bool:
    """Whether a link (from a sender on this worker's device or not) comes through the engine's own
    group (``DistributedBucketEngine``); the strategy raises where its transport cannot serve it."""
    return isinstance(strategy, DistributedBucketEngine) and strategy.uses_engine_group(colocated)


def _engine_receives(strategy: Any, spec: LinkSpec, rank: int) -> bool:
    """Whether the engine takes this link's buckets in its own processes (see the module docstring)."""
    if spec.is_local(rank):
        _engine_group(strategy, colocated=True)  # raises where the transport asks for the group
        return isinstance(strategy, SharedBucketEngine)
    if spec.engine_group:
        return True
    return isinstance(strategy, BroadcastBucketEngine)


def _engine_join(engine: Any, spec: LinkSpec, rank: int):
    if spec.is_local(rank):
        return None

    def join(host: str, port: int, prefix: str, rank_offset: int, world_size: int, backend: str) -> None:
        if spec.engine_group:  # the engine builds the group itself, named by the link's data prefix
            engine.init_weights_update_group(host, port, rank_offset, world_size, prefix, backend)
        else:
            engine.join_model_update_group(host, port, prefix, rank_offset, world_size, backend)

    return join


def _engine_hf_weights(strategy: Any) -> dict[str, torch.Tensor] | None:
    """The engine's weights by HF name, where it can tell (an ``HFWeightSource``)."""
    if isinstance(strategy, HFWeightSource):
        return {name: t.detach().clone() for name, t in strategy.iter_hf_weights()}
    return None
