"""One link: a trainer rank (the sender) and every inference worker it feeds.

Each trainer rank gets a link; ranks whose ``iter_hf_weights`` yields nothing send one empty last
bucket per update. A receiver on the sender's own device is *local* (it maps the sender's bucket
buffers: CUDA IPC / shared memory); the others are *remote* (NCCL broadcast on GPU, gloo on CPU).
Up to three groups per link, all over one ``TCPStore`` hosted by the sender:

- control (gloo, sender + every receiver): bucket metadata and IPC handles;
- acks (gloo, sender + local receivers): "done reading your buffer". Absent without local receivers;
- data (NCCL or gloo, sender + remote receivers): the bucket bytes. Absent without remote receivers.

    spec = LinkSpec("actor_train->actor_infer/0", sender=0, host=ip, port=port,
                    receivers=(0, 1), local=(True, False), backend="nccl")
    link = Link.connect(spec, member="sender", device=device)        # on trainer rank 0
    link = Link.connect(spec, member=1, device=device)               # on inference rank 1

A remote receiver whose engine receives in its own processes (vLLM's TP workers, SGLang's
schedulers) passes ``join_data``: the engine joins the data group with ``data_ranks`` ranks instead
of this process. With ``engine_group`` the engine builds that group its own way (SGLang's
``init_weights_update_group`` at the link's store, host:port) and the sender's end matches it
(``process_group.engine_group``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from roll.distributed.transport.broadcast import BroadcastTransport
from roll.distributed.transport.control import ControlChannel
from roll.distributed.transport.process_group import DEFAULT_TIMEOUT, engine_group, new_group, open_store


@dataclass(frozen=True)
class LinkSpec:
    name: str
    sender: int
    host: str
    port: int
    # Inference ranks fed by this link, and whether each shares the sender's device.
    receivers: tuple[int, ...]
    local: tuple[bool, ...]
    backend: str
    # The sender's global device id (None on CPU-only roles).
    sender_device: int | None = None
    # Ranks each receiver takes in the data group (engines with TP worker processes take several).
    data_ranks: tuple[int, ...] | None = None
    # The remote receivers' engines build the data group themselves, as torch.distributed builds a
    # group from a tcp:// init method (SGLang's init_weights_update_group), and take each bucket as
    # one broadcast of its tensors back to back, with no padding (``bucket.tight_bucket``).
    engine_group: bool = False

    def __post_init__(self) -> None:
        if len(self.receivers) != len(self.local):
            raise ValueError(
                f"link {self.name}: {len(self.receivers)} receivers but {len(self.local)} local flags"
            )
        if self.data_ranks is not None and len(self.data_ranks) != len(self.receivers):
            raise ValueError(
                f"link {self.name}: {len(self.receivers)} receivers but {len(self.data_ranks)} data_ranks"
            )

    def ranks_of(self, receiver: int) -> int:
        return 1 if self.data_ranks is None else self.data_ranks[self.receivers.index(receiver)]

    @property
    def data_world_size(self) -> int:
        return 1 + sum(self.ranks_of(r) for r in self.remote_receivers)

    def data_rank_offset(self, receiver: int) -> int:
        """First rank of ``receiver`` in the data group (the sender is rank 0)."""
        remote = self.remote_receivers
        return 1 + sum(self.ranks_of(r) for r in remote[: remote.index(receiver)])

    @property
    def data_prefix(self) -> str:
        """The data group's name in the store; an engine that joins several links tells them apart by it."""
        return f"{self.name}/data"

    @property
    def remote_receivers(self) -> tuple[int, ...]:
        return tuple(r for r, is_local in zip(self.receivers, self.local) if not is_local)

    @property
    def local_receivers(self) -> tuple[int, ...]:
        return tuple(r for r, is_local in zip(self.receivers, self.local) if is_local)

    def control_rank(self, receiver: int) -> int:
        return 1 + self.receivers.index(receiver)

    def is_local(self, receiver: int) -> bool:
        return self.local[self.receivers.index(receiver)]


class Link:
    """The connected groups of one link, as seen by one member."""

    def __init__(
        self,
        spec: LinkSpec,
        member: str | int,
        control: ControlChannel,
        data: BroadcastTransport | None,
        store,
    ):
        self.spec = spec
        self.member = member
        self.control = control
        self.data = data
        self._store = store

    @property
    def is_sender(self) -> bool:
        return self.member == "sender"

    @property
    def is_local(self) -> bool:
        """Receiver side: this receiver maps the sender's buffers instead of receiving a broadcast."""
        return not self.is_sender and self.spec.is_local(self.member)

    @classmethod
    def connect(
        cls,
        spec: LinkSpec,
        member: str | int,
        device: torch.device,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        join_data: Callable[[str, int, str, int, int, str], Any] | None = None,
    ) -> Link:
        """Join the link's groups; every member of the link must call this concurrently.

        ``join_data(host, port, prefix, rank_offset, world_size, backend)`` joins the data group on
        a remote receiver's behalf (its engine's processes take ``spec.ranks_of(member)`` ranks)."""
        is_sender = member == "sender"
        world = 1 + len(spec.receivers)
        store = open_store(spec.host, spec.port, world, is_sender, timeout)
        control_rank = 0 if is_sender else spec.control_rank(member)
        control_group = new_group("gloo", store, f"{spec.name}/control", control_rank, world, timeout)
        ack_group, ack_rank = None, None
        local = spec.local_receivers
        if local and (is_sender or member in local):
            ack_rank = 0 if is_sender else 1 + local.index(member)
            ack_group = new_group("gloo", store, f"{spec.name}/acks", ack_rank, 1 + len(local), timeout)
        control = ControlChannel(control_group, control_rank, ack_group, ack_rank)
        data = None
        remote = spec.remote_receivers
        prefix, world = spec.data_prefix, spec.data_world_size
        if remote and is_sender and spec.engine_group:
            data = BroadcastTransport(engine_group(spec.backend, store, prefix, 0, world, timeout), 0)
        elif remote and is_sender:
            data = BroadcastTransport(new_group(spec.backend, store, prefix, 0, world, timeout), 0)
        elif member in remote and join_data is not None:
            join_data(spec.host, spec.port, prefix, spec.data_rank_offset(member), world, spec.backend)
        elif member in remote:
            if spec.engine_group:
                raise ValueError(
                    f"link {spec.name}: receiver {member}'s engine builds the data group; pass join_data"
                )
            if spec.ranks_of(member) != 1:
                raise ValueError(
                    f"link {spec.name}: receiver {member} takes {spec.ranks_of(member)} data ranks but has no join_data"
                )
            rank = spec.data_rank_offset(member)
            data = BroadcastTransport(new_group(spec.backend, store, prefix, rank, world, timeout), rank)
        return cls(spec, member, control, data, store)
