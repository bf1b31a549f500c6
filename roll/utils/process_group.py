"""Join torch.distributed's default process group: the one place a roll process does it.

A role's workers join at start-up (``Worker.init_process_group``, rendezvous at rank 0's address);
a strategy built outside a worker (tests, scripts) or on a single-rank role makes its own from
``MASTER_ADDR``/``MASTER_PORT``, or from a free loopback port when it is alone; the checkpoint
converter's spawned ranks join at a port their parent chose::

    init_default_group(rank, world_size, torch.device("cpu"), master_addr="127.0.0.1", master_port=port)

A process already in a group is only checked: the same rank and size, else a RuntimeError naming
``who`` (a group of another layout would make every collective wrong).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from roll.utils.ports import free_port
from roll.utils.tcp_store import open_tcp_store


def init_default_group(
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    who: str = "this process",
) -> bool:
    """Join the default group as ``rank`` of ``world_size`` (or check the one joined); returns
    whether this call made it.

    The rendezvous is ``master_addr:master_port``, else ``MASTER_ADDR``/``MASTER_PORT`` of the
    environment, else (one rank only) a free loopback port; its store listens on loopback only when
    the address is loopback (``tcp_store``). ``backend`` defaults to nccl on a CUDA ``device`` and
    gloo on CPU; a CUDA process binds the group to ``device``."""
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"{who}: the default process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but this process is rank {rank} of {world_size}"
            )
        return False
    master_addr = master_addr or os.environ.get("MASTER_ADDR")
    port = master_port or os.environ.get("MASTER_PORT")
    if master_addr is None or port is None:
        if world_size != 1:
            raise RuntimeError(
                f"{who}: {world_size} ranks need MASTER_ADDR and MASTER_PORT in the environment "
                "to form their process group"
            )
        master_addr, port = "127.0.0.1", free_port("127.0.0.1")
    cuda = device.type == "cuda"
    store = open_tcp_store(master_addr, int(port), world_size, rank == 0, default_pg_timeout)
    dist.init_process_group(
        backend=backend or ("nccl" if cuda else "gloo"),
        store=store,
        rank=rank,
        world_size=world_size,
        device_id=device if cuda else None,
    )
    return True
