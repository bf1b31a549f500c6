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
import os

import torch.distributed as dist

from roll.utils.tcp_store import open_tcp_store

# How long one store wait or collective of a model update may block before it raises (gloo) or the
# NCCL watchdog aborts the process: either way the driver gets a WorkerError naming the role and
# rank instead of a silent hang. A whole update of a 7B model takes well under a second on H200, and
# the longest legitimate wait (a receiver's link to a trainer rank that sends only its empty last
# bucket, after the other ranks' whole export) is the export time; 10 minutes leaves a wide margin.
# ROLL_MODEL_UPDATE_TIMEOUT_S overrides it (set it in system_envs for very large exports).
DEFAULT_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("ROLL_MODEL_UPDATE_TIMEOUT_S", 600)))
BACKENDS = ("gloo", "nccl")


def open_store(
    host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> dist.TCPStore:
    """The rendezvous store of one link; the master (the sender) hosts it, the others connect
    (on loopback only when ``host`` is a loopback address)."""
    return open_tcp_store(host, port, world_size, is_master, timeout, wait_for_workers=False)


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
    return _backend(backend, dist.PrefixStore(prefix, store), rank, world_size, timeout)


def _backend(backend: str, scoped: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(scoped, rank, world_size, timeout)
    try:
        return dist.ProcessGroupNCCL(scoped, rank, world_size, timeout)
    except TypeError:  # builds whose binding only takes Options
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(scoped, rank, world_size, options)


def engine_group(
    backend: str,
    store: dist.Store,
    name: str,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
):
    """Our end of a group that an engine's own processes build the way ``torch.distributed`` builds
    a group from a ``tcp://`` init method (SGLang's ``init_weights_update_group``): the store scoped
    by ``PrefixStore(name)``, then by torch's group helper with ``f"{name}/"`` and the first device
    kind the backend serves (``f"cpu/"`` for gloo, ``f"cuda/"`` for nccl: one backend serves them
    all when it is the same for every kind).

    Built without torch's helper (``_new_process_group_helper``), which in a trainer whose default
    group is bound to its device would split the new communicator off the default one, a group the
    engine does not belong to.

        group = engine_group("nccl", store, "actor_train->actor_infer/0/data", rank=0, world_size=3)
        group.broadcast([flat], broadcast_options(0)).wait()
    """
    if backend not in BACKENDS:
        raise ValueError(f"model-update backend must be one of {list(BACKENDS)}, got {backend!r}")
    device = dist.Backend.backend_capability[backend][0]
    scoped = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
    return _backend(backend, scoped, rank, world_size, timeout)


def broadcast_options(root: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return opts
