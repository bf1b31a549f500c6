"""Disaggregated transport: the sender broadcasts each flat bucket to every remote receiver.

One group per link (NCCL on GPU, gloo on CPU), rank 0 = the sender, ranks 1.. = the receivers
that do not share the sender's device. Calls are asynchronous: they return the group's ``Work``.
On CUDA the broadcast is issued on the caller's current stream (``ProcessGroupNCCL`` makes its
own stream wait on it), so a sender that packs on a side stream and issues the broadcast from that
stream overlaps packing bucket k+1 with sending bucket k; ``work.wait()`` then makes the current
stream (not the host) wait for the transfer.

    transport = BroadcastTransport(group, rank)
    work = transport.send(flat)           # sender
    work = transport.recv(buffer[:n])     # receivers; the data is there once work is waited on
"""

from __future__ import annotations

import torch

from roll.distributed.transport.process_group import broadcast_options


class BroadcastTransport:
    """Flat uint8 buffers from rank 0 to every other rank of ``group``."""

    def __init__(self, group, rank: int):
        self.group = group
        self.rank = rank

    def send(self, flat: torch.Tensor):
        if self.rank != 0:
            raise RuntimeError("only the sender (rank 0) sends on a broadcast transport")
        return self.group.broadcast([flat], broadcast_options(0))

    def recv(self, flat: torch.Tensor):
        if self.rank == 0:
            raise RuntimeError("the sender (rank 0) cannot receive on its own broadcast transport")
        return self.group.broadcast([flat], broadcast_options(0))
