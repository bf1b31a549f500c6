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
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from roll.distributed.model_update.broadcast import BroadcastTransport
from roll.distributed.model_update.control import ControlChannel
from roll.distributed.model_update.process_group import DEFAULT_TIMEOUT, new_group, open_store


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

    def __post_init__(self) -> None:
        if len(self.receivers) != len(self.local):
            raise ValueError(
                f"link {self.name}: {len(self.receivers)} receivers but {len(self.local)} local flags"
            )

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
    ) -> Link:
        """Join both groups; every member of the link must call this concurrently."""
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
        if remote and (is_sender or member in remote):
            data_rank = 0 if is_sender else 1 + remote.index(member)
            group = new_group(spec.backend, store, f"{spec.name}/data", data_rank, 1 + len(remote), timeout)
            data = BroadcastTransport(group, data_rank)
        return cls(spec, member, control, data, store)
