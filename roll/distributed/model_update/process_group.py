"""Extra process groups between Ray actors that already have their own default group.

``torch.distributed.new_group`` only splits the default world, and the trainer and the engines
belong to different worlds (one per role). So a model-update group is built by hand: a
``TCPStore`` hosted by the sender, wrapped in a ``PrefixStore`` per group, and the backend class
constructed directly (``ProcessGroupGloo(store, rank, size, timeout)`` /
``ProcessGroupNCCL(store, rank, size, timeout)``). The default group is never touched, and the
collectives are called on the backend object (``group.broadcast([t], opts)``), not through
``torch.distributed.broadcast``. Works with torch 2.13 (CPU, gloo) and torch 2.11 (CUDA, NCCL).

    store = open_store(host, port, world_size=3, is_master=rank == 0)
    group = new_group("gloo", store, "link0/ctrl", rank, 3)
    work = group.broadcast([tensor], broadcast_options(root=0)); work.wait()
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
BACKENDS = ("gloo", "nccl")


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def open_store(
    host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> dist.TCPStore:
    """The rendezvous store of one link; the master (the sender) hosts it, the others connect."""
    return dist.TCPStore(host, port, world_size, is_master, timeout, wait_for_workers=False)


def new_group(
    backend: str,
    store: dist.Store,
    prefix: str,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
):
    """A ``ProcessGroupGloo``/``ProcessGroupNCCL`` over ``store`` under ``prefix`` (every member
    must call this with the same prefix and world size at about the same time)."""
    if backend not in BACKENDS:
        raise ValueError(f"model-update backend must be one of {list(BACKENDS)}, got {backend!r}")
    scoped = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(scoped, rank, world_size, timeout)
    try:
        return dist.ProcessGroupNCCL(scoped, rank, world_size, timeout)
    except TypeError:  # builds whose binding only takes Options
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(scoped, rank, world_size, options)


def broadcast_options(root: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return opts
