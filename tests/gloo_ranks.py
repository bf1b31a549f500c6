"""Ranks of a multi-process test: spawn them, and let each join and leave the default group.

Every multi-rank CPU test runs its ranks as fresh processes (``start_processes``: forked from a
fork server that imported torch, transformers and megatron-core once, spawned where CUDA is) over a
gloo group on loopback; this is the one copy of that start-up and teardown.

>>> def worker(rank: int, world_size: int, port: int, out: str) -> None:  # top level: spawn pickles it
...     with process_group(rank, world_size, port):
...         ...  # collectives over the default group
>>> spawn_ranks(worker, 2, str(tmp_path))  # worker(rank, 2, port, str(tmp_path)) on ranks 0 and 1
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import random
import sys
from collections.abc import Callable, Iterator

import numpy
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roll.utils.ports import free_port

# What every rank imports, imported once by the fork server (``_forked``) instead of by each rank:
# about 6 CPU-seconds a rank (megatron-core alone ~3), most of a small test's time on two cores.
# Missing ones (megatron-core not installed) are skipped by the fork server.
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "roll.distributed.strategy.megatron_strategy",
    "roll.distributed.strategy.fsdp2_strategy",
]


def spawn_ranks(worker: Callable[..., None], world_size: int, *args) -> None:
    """Run ``worker(rank, world_size, port, *args)`` on ``world_size`` fresh processes
    (``start_processes``) and wait for all of them; a rank that raises fails the call (the others are
    stopped). ``port`` is a free loopback port for the group's rendezvous."""
    start_processes(_rank_main, world_size, worker, world_size, free_port(), *args)


def start_processes(fn: Callable[..., None], nprocs: int, *args) -> None:
    """Run ``fn(i, *args)`` for i in 0..nprocs-1 on fresh processes and wait for all of them
    (``torch.multiprocessing.start_processes``: the first to raise fails the call).

    Without CUDA they are forked from a fork server that imported ``PRELOAD`` once per test session,
    each given this process's ``sys.path`` and environment as they are now before ``fn`` and ``args``
    are unpickled (so a test module's worker imports from the path the test set up); never forked
    from this process, whose earlier tests may have left threads (Ray, gloo) behind. With CUDA they
    are spawned: a fork server must not initialize CUDA before a test picks its devices."""
    if torch.cuda.is_available():
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")
        return
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    call = (list(sys.path), dict(os.environ), pickle.dumps((fn, args)))
    mp.start_processes(_forked, args=call, nprocs=nprocs, join=True, start_method="forkserver")


def _forked(i: int, path: list[str], env: dict[str, str], payload: bytes) -> None:
    """Process ``i``, forked from the fork server: the starting process's import path and
    environment, Python's and numpy's global generators seeded afresh (forked ones would all share
    the server's state; a spawned process seeds them from the OS), then its function and arguments,
    unpickled only now."""
    sys.path[:] = path
    os.environ.clear()
    os.environ.update(env)
    random.seed()
    numpy.random.seed()
    fn, args = pickle.loads(payload)
    fn(i, *args)


def _rank_main(rank: int, worker: Callable[..., None], world_size: int, port: int, *args) -> None:
    """One rank: the worker, then an exit that skips interpreter finalization once it succeeded.
    Gloo's worker threads may still hold finished work (and its tensors) after the group is
    destroyed; releasing them while Python finalizes aborts the process ("terminate called without
    an active exception", about 1 run in 30 of the fsdp2 grouped-gather test, on CI too), which would
    fail a rank whose work was done and checked. A rank that raised exits the normal way, so its
    traceback reaches ``start_processes``."""
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
