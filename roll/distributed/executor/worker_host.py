"""``WorkerHost``: one Ray actor (one process) holding the workers of several roles on one CPU slot.

Which workers share a host is planned by ``roll/distributed/scheduler/hosting.py``; the driver
starts one host per plan and hands each role's ``Cluster`` a ``HostedWorker`` per rank, which it
calls like an actor handle::

    host = start_host(plan, env, options)                  # the process starts (imports once)
    worker = HostedWorker(host, "actor_infer", 0)
    ray.get(worker.add(ModelWorker, args))                 # ModelWorker(*args) inside the host
    ref = worker.generate.remote(batch, params)            # runs ModelWorker.generate there

Each (role, rank) has its own Ray concurrency group of one thread, so one member's calls run one
at a time and in the order they were sent, as on a worker of its own, while different members'
calls may run together: a model update needs the trainer's send and the engine's receive at once.

The host applies the one environment its device members share (their ``RANK``, ``WORLD_SIZE``,
devices, threads, ``system_envs``); its workers are built with ``shared_process=True`` and leave
the process environment alone. The host is killed once every member's cluster has let it go
(``release``), or at once when a member fails (``kill``): ranks of the other roles waiting on it in
a collective then fail too instead of hanging.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any

import ray
from ray.exceptions import RayError


class WorkerHost:
    """The actor body: a table of workers by (role, rank) and a call that routes to one of them."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()):
        os.environ.update(env)
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        for module in preload:  # the members' worker and strategy modules, imported before they come
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001 - the member's own import raises it where it belongs
                pass
        self.workers: dict[tuple[str, int], Any] = {}
        # Held by one member at a time while it is built or runs a method its class lists in
        # ``one_member_at_a_time`` (``initialize``: transformers' lazy imports are not thread-safe).
        self.serial = threading.Lock()

    def add(self, role: str, rank: int, worker_cls: type, args: tuple) -> dict[str, Any]:
        """Build ``worker_cls(*args, shared_process=True)`` as member (role, rank); returns where
        the process runs (``{"pid", "node"}``), for naming it should it die."""
        with self.serial:
            self.workers[(role, rank)] = worker_cls(*args, shared_process=True)
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address()}

    def call(self, role: str, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        worker = self.workers.get((role, rank))
        if worker is None:
            raise RuntimeError(f"{role} rank {rank} is not on this host (members: {sorted(self.workers)})")
        if method in getattr(worker, "one_member_at_a_time", ()):
            with self.serial:
                return getattr(worker, method)(*args, **kwargs)
        return getattr(worker, method)(*args, **kwargs)


def member_key(role: str, rank: int) -> str:
    """The name of the concurrency group of member (role, rank)."""
    return f"{role}#{rank}"


class HostRef:
    """The driver's handle on one host actor: who still uses it, and killing it."""

    def __init__(self, actor: ray.actor.ActorHandle, members: tuple[tuple[str, int], ...]):
        self.actor = actor
        self.members = members
        self.users: set[tuple[str, int]] = set()  # members whose worker was added and not released
        self.hosted: list[tuple[str, int]] = []  # every member whose worker was added
        self.where: dict[str, Any] = {}  # {"pid", "node"}, once a member's ``add`` has returned
        self.killed = False  # by the driver (``kill``), as opposed to a death of its own
        self._lock = threading.Lock()

    def use(self, role: str, rank: int) -> None:
        with self._lock:
            self.users.add((role, rank))
            if (role, rank) not in self.hosted:
                self.hosted.append((role, rank))

    def describe(self) -> str:
        """``host process pid <p> on <node> (<role> rank <r>, ...)``: the process and every
        member it hosted, for an error that is the process's and not one role's (it died)."""
        where = f"pid {self.where['pid']} on {self.where['node']}" if self.where else "(not started)"
        held = [m for m in self.members if m in self.hosted] or list(self.members)  # in plan order
        members = ", ".join(f"{role} rank {rank}" for role, rank in held)
        return f"host process {where} ({members})"

    def release(self, role: str, rank: int) -> None:
        """Member (role, rank) is done; the last one out kills the host."""
        with self._lock:
            self.users.discard((role, rank))
            last = not self.users
        if last:
            self.kill()

    def kill(self) -> None:
        """End the process (``kill_actor``)."""
        self.killed = True
        kill_actor(self.actor)


def kill_actor(actor: Any) -> None:
    """End an actor's process. Nothing to do once Ray is down (``ray.kill`` would start a new Ray
    and raise ActorHandleNotFoundError) or the actor is already gone."""
    if not ray.is_initialized():
        return
    try:
        ray.kill(actor, no_restart=True)
    except RayError:
        pass


def start_host(
    members: tuple[tuple[str, int], ...],
    env: dict[str, str],
    options: dict[str, Any],
    preload: tuple[str, ...] = (),
) -> HostRef:
    """Start one host actor for ``members``; it applies ``env`` and imports ``preload`` (module
    names) before any member arrives. Returns at once."""
    groups = {member_key(role, rank): 1 for role, rank in members}
    actor_cls = ray.remote(concurrency_groups=groups)(WorkerHost)
    options = {**options, "runtime_env": {"env_vars": env}}
    return HostRef(actor_cls.options(**options).remote(env, preload), members)


class HostedWorker:
    """A member of a host, called like the actor handle of a worker of its own:
    ``worker.<method>.remote(*args)`` runs ``<method>`` of the member's worker in the host."""

    def __init__(self, host: HostRef, role: str, rank: int):
        self.host = host
        self.role = role
        self.rank = rank

    def add(self, worker_cls: type, args: tuple) -> ray.ObjectRef:
        """Build the member's worker in the host (the first call of its concurrency group)."""
        self.host.use(self.role, self.rank)
        return self._send("add").remote(self.role, self.rank, worker_cls, args)

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(self, method)

    def _send(self, name: str):
        return getattr(self.host.actor, name).options(concurrency_group=member_key(self.role, self.rank))

    def release(self) -> None:
        self.host.release(self.role, self.rank)

    def kill(self) -> None:
        self.host.kill()


class _Method:
    def __init__(self, worker: HostedWorker, name: str):
        self.worker = worker
        self.name = name

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        w = self.worker
        return w._send("call").remote(w.role, w.rank, self.name, *args, **kwargs)
