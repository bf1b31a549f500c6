"""The control channel of a link: bucket metadata from the sender to every receiver, acks back.

It runs over gloo groups on CPU tensors, so metadata never waits behind GPU work: a receiver
learns the next bucket's layout while its GPU still loads the previous one. Rank 0 is the sender.
Acks from colocated receivers travel point to point on a group of their own (sender + colocated
receivers): gloo numbers collectives and tagged sends in one space, so mixing them on one group
can match an ack with a broadcast.

    channel = ControlChannel(gloo_group, rank, ack_group, ack_rank)
    channel.send((meta, handle))          # sender: one broadcast (two when the pickle is large)
    meta, handle = channel.recv()         # receivers
    channel.ack(); channel.wait_acks()    # colocated receivers release a shared buffer
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from roll.distributed.transport.process_group import broadcast_options

# Messages up to this size (length header included) take one broadcast; larger ones take two.
HEADER_BYTES = 64 << 10
_ACK_TAG = 17


class ControlChannel:
    """Pickled messages over a gloo group (rank 0 sends). Objects must be small and picklable."""

    def __init__(self, group, rank: int, ack_group=None, ack_rank: int | None = None):
        self.group = group
        self.rank = rank
        self.ack_group = ack_group
        self.ack_rank = ack_rank
        self._header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        # Gloo sends wait for the matching receive, and the sender receives an ack only when it
        # needs the buffer again (after sending the next bucket's metadata), so acks are posted
        # asynchronously and completed in ``finish_acks``.
        self._pending_acks: list = []

    def send(self, obj: Any) -> None:
        if self.rank != 0:
            raise RuntimeError("only the sender (rank 0) sends on a control channel")
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        head = min(len(payload), HEADER_BYTES - 8)
        self._header[:8].view(torch.int64)[0] = len(payload)
        self._header[8 : 8 + head].copy_(data[:head])
        self._broadcast(self._header)
        if len(payload) > head:
            self._broadcast(data[head:].clone())

    def recv(self) -> Any:
        self._broadcast(self._header)
        length = int(self._header[:8].view(torch.int64)[0])
        head = min(length, HEADER_BYTES - 8)
        payload = bytearray(self._header[8 : 8 + head].numpy().tobytes())
        if length > head:
            rest = torch.empty(length - head, dtype=torch.uint8)
            self._broadcast(rest)
            payload += rest.numpy().tobytes()
        return pickle.loads(bytes(payload))

    def ack(self) -> None:
        """Colocated receiver: tell the sender that the last bucket's shared buffer may be reused."""
        if self.ack_group is None or not self.ack_rank:
            raise RuntimeError("this member is not a colocated receiver of the link; it has nothing to ack")
        ack = torch.full((1,), self.ack_rank, dtype=torch.int64)
        self._pending_acks.append((ack, self.ack_group.send([ack], 0, _ACK_TAG)))

    def finish_acks(self) -> None:
        """Colocated receiver: wait until the sender has taken every ack posted so far."""
        for _, work in self._pending_acks:
            work.wait()
        self._pending_acks.clear()

    def wait_acks(self) -> None:
        """Sender: wait for one ack from every colocated receiver (acks queue up per peer, in order)."""
        if self.ack_group is None:
            return
        box = torch.zeros(1, dtype=torch.int64)
        for rank in range(1, self.ack_group.size()):
            self.ack_group.recv([box], rank, _ACK_TAG).wait()

    def barrier(self) -> None:
        self.group.barrier().wait()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast([tensor], broadcast_options(0)).wait()
