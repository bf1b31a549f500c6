"""Ranks of a multi-process test: spawn them, and let each join and leave the default group.

Every multi-rank CPU test runs its ranks as fresh processes (``mp.spawn``) over a gloo group on
loopback; this is the one copy of that start-up and teardown.

>>> def worker(rank: int, world_size: int, port: int, out: str) -> None:  # top level: spawn pickles it
...     with process_group(rank, world_size, port):
...         ...  # collectives over the default group
>>> spawn_ranks(worker, 2, str(tmp_path))  # worker(rank, 2, port, str(tmp_path)) on ranks 0 and 1
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roll.utils.ports import free_port


def spawn_ranks(worker: Callable[..., None], world_size: int, *args) -> None:
    """Run ``worker(rank, world_size, port, *args)`` on ``world_size`` spawned processes and wait for
    all of them; a rank that raises fails the call (``mp.spawn`` stops the others). ``port`` is a free
    loopback port for the group's rendezvous."""
    mp.spawn(_rank_main, args=(worker, world_size, free_port(), *args), nprocs=world_size, join=True)


def _rank_main(rank: int, worker: Callable[..., None], world_size: int, port: int, *args) -> None:
    """One rank: the worker, then an exit that skips interpreter finalization once it succeeded.
    Gloo's worker threads may still hold finished work (and its tensors) after the group is
    destroyed; releasing them while Python finalizes aborts the process ("terminate called without
    an active exception", about 1 run in 30 of the fsdp2 grouped-gather test, on CI too), which would
    fail a rank whose work was done and checked. A rank that raised exits the normal way, so its
    traceback reaches ``mp.spawn``."""
    worker(rank, world_size, port, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def process_group(
    rank: int,
    world_size: int,
    port: int,
    *,
    backend: str = "gloo",
    timeout: datetime.timedelta | None = None,
    init: bool = True,
) -> Iterator[None]:
    """This rank in the default process group for the block, on one CPU thread.

    Sets ``MASTER_ADDR``/``MASTER_PORT`` to loopback:``port`` and joins (``backend``, torch's
    default timeout unless ``timeout``); with ``init=False`` the code under test joins by itself
    (a strategy's ``init_default_group`` reads those variables). On leaving, every rank waits for
    the others (``barrier``) before it destroys the group: a rank that tore gloo down while its peer
    still waited on the last message made that peer abort ("terminate called without an active
    exception"). A block that raises skips the barrier, so its peers fail at once instead of
    waiting for a rank that will not come.
    """
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if init:
        options = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(backend, rank=rank, world_size=world_size, **options)
    try:
        yield
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
