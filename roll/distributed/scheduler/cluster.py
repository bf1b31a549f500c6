"""``Cluster``: the driver's handle on all workers of one role.

A role's cluster class has one typed method per worker call (``ModelCluster`` in
``roll/pipeline/workers/model_worker.py``, ``RewardCluster`` next to ``RewardWorker``); each names
the worker method it runs, so a reader (and a type checker) follows ``actor_train.compute_log_probs``
to ``ModelWorker.compute_log_probs``. The dispatch mode is the one the worker method declares with
``@register`` (see ``roll/distributed/executor/dispatch.py``)::

    rm = ResourceManager(plan, config.device)
    actor_train = ModelCluster("actor_train", ModelWorker, rm, plan.roles["actor_train"], config.actor_train, config)
    actor_train.initialize()                               # every rank; then re-reads the DP layout
    out = actor_train.compute_log_probs(batch)             # DP_COMPUTE: split over DP ranks, concatenated
    pending = actor_train.async_call(ModelWorker.train_step, batch, loss_fn, seed)  # returns at once ...
    metrics = pending.get()                                # ... and gathers here
    actor_train.call(Worker.ping)                          # any registered method of the worker class
    actor_train.shutdown()

Errors: the first worker task that fails raises ``WorkerError("<role> rank <r>: <Type>: <msg>")`` in
the driver, and every worker of the role is killed, so ranks waiting in a collective for the failed
one do not hang. A worker process that dies is reported the same way, and a call that does not
return within its ``worker_timeouts`` entry raises ``WorkerTimeout`` (see ``watchdog.py``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Concatenate, Generic, ParamSpec, TypeVar

import ray
from ray.exceptions import ActorDiedError, RayActorError, RayError

from roll.configs.strategies import get_strategy_spec, strategies_run_env
from roll.configs.timeouts import WorkerTimeoutsConfig
from roll.core.batch import Batch
from roll.distributed.executor.dispatch import (
    Dispatch,
    DPRank,
    check_dp_layout,
    dispatch_mode,
    gather_from_dp,
    split_for_dp,
)
from roll.distributed.executor.worker import Worker
from roll.distributed.executor.worker_host import HostedWorker, HostRef, kill_actor
from roll.distributed.scheduler.errors import WorkerError, WorkerTimeout
from roll.distributed.scheduler.placement import RolePlan
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.distributed.scheduler.watchdog import Deadline
from roll.utils.ports import answers

if TYPE_CHECKING:
    from roll.configs.pipeline_config import RLVRConfig
    from roll.configs.role import RoleConfig


logger = logging.getLogger("roll")

P = ParamSpec("P")
T = TypeVar("T")

# How long ``Cluster.shutdown`` lets the workers leave their process groups before killing them.
SHUTDOWN_TIMEOUT_S = 30.0


class AsyncResult(Generic[T]):
    """Calls running on some workers of one cluster; ``get()`` waits for them and gathers the results.
    ``deadline``: when they must have returned (``worker_timeouts``, see ``watchdog.py``)."""

    def __init__(
        self,
        cluster: Cluster,
        refs: list[ray.ObjectRef],
        ranks: list[int],
        gather: Callable[[list], T],
        method: str = "",
    ):
        self.cluster = cluster
        self.refs = refs
        self.ranks = ranks
        self.gather = gather
        self.deadline = Deadline.start(cluster.timeouts, method)

    def get(self) -> T:
        return get_all(self)[0]


def get_all(*results: AsyncResult) -> list[Any]:
    """Wait for calls on one or several clusters together; the first failure anywhere raises at once.

    Use it when roles wait on each other (e.g. a weight broadcast from actor_train to actor_infer):
    waiting on one role first would hang if the other one failed. A call still running at its
    deadline raises ``WorkerTimeout`` (the watchdog).
    """
    owner = {ref: (result, rank) for result in results for ref, rank in zip(result.refs, result.ranks)}
    values: dict[ray.ObjectRef, Any] = {}
    pending = list(owner)
    started = time.monotonic()
    report_at = started + STALL_REPORT_AFTER_S
    while pending:
        wait_s = min(owner[ref][0].deadline.remaining() for ref in pending)
        wait_s = max(0.0, min(wait_s, report_at - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if not ready:
            _raise_overdue(pending, owner)
            if time.monotonic() >= report_at:
                logger.warning(waiting_line(pending, owner, time.monotonic() - started))
                report_at += STALL_REPORT_EVERY_S
        for ref in ready:
            try:
                values[ref] = ray.get(ref)
            except RayError as exc:
                ref, exc = _root_failure(ref, exc, pending)
                result, rank = owner[ref]
                raise result.cluster._fail(rank, exc) from None
    return [result.gather([values[ref] for ref in result.refs]) for result in results]


# A wait longer than this logs which role, ranks and call it waits on, and again every
# STALL_REPORT_EVERY_S (a start-up that stalls names what it waits for while it waits).
STALL_REPORT_AFTER_S = 60.0
STALL_REPORT_EVERY_S = 30.0


def waiting_line(pending: list[ray.ObjectRef], owner: dict, waited_s: float) -> str:
    """``still waiting after 90 s for actor_infer ranks [0, 1] (initialize); reference rank 0 (...)``."""
    ranks: dict[AsyncResult, list[int]] = {}
    for ref in pending:
        result, rank = owner[ref]
        ranks.setdefault(result, []).append(rank)
    parts = [
        f"{result.cluster.role} rank{'s' if len(r) > 1 else ''} {r if len(r) > 1 else r[0]} "
        f"({result.deadline.method or 'call'}, {result.deadline.remaining():.0f} s left of {result.deadline.key})"
        for result, r in ranks.items()
    ]
    return f"still waiting after {waited_s:.0f} s for " + "; ".join(parts)


# How long a failure waits for a dead worker among the other pending calls (see ``_root_failure``).
DEATH_GRACE_S = 2.0


def _root_failure(
    ref: ray.ObjectRef, exc: RayError, pending: list[ray.ObjectRef]
) -> tuple[ray.ObjectRef, RayError]:
    """The failure to report: a worker whose process died makes its peers' collectives fail too
    (gloo: "connection closed by peer"), sometimes before Ray reports the death. A failure that is
    not itself a death therefore waits up to ``DEATH_GRACE_S`` for a death among the other pending
    calls and names that one, the cause, instead of the peer's symptom."""
    if isinstance(exc, ActorDiedError) or not pending:
        return ref, exc
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
    for other in done:
        try:
            ray.get(other)
        except ActorDiedError as died:
            return other, died
        except RayError:
            continue
    return ref, exc


def _raise_overdue(pending: list[ray.ObjectRef], owner: dict) -> None:
    """Raise WorkerTimeout for the first call past its deadline, naming its ranks that are not done."""
    _, running = ray.wait(pending, num_returns=len(pending), timeout=0)
    for result in dict.fromkeys(owner[ref][0] for ref in running):
        if result.deadline.passed():
            late = [owner[ref][1] for ref in running if owner[ref][0] is result]
            raise result.cluster._time_out(late, result.deadline)


def worker_extra_env(pipeline_config: Any, role_config: RoleConfig) -> dict[str, str]:
    """Environment a role's workers get beyond their devices: what the run's strategies need
    (``StrategySpec.run_env``), then the run's ``system_envs``, then the role's (later ones win)."""
    if pipeline_config is None:
        return dict(role_config.system_envs)
    return {
        **strategies_run_env(pipeline_config.roles().values()),
        **pipeline_config.system_envs,
        **role_config.system_envs,
    }


class Cluster:
    """All Ray actors of one role; see the module docstring for an example.

    Subclasses add the typed methods of their worker class and set ``worker_base`` to it; the
    ``worker_cls`` given must be that class or a subclass (tests add read-outs or faults that way).

    ``hosts`` (one per rank): build the workers inside those host processes, shared with other
    roles (CPU slots, ``roll/distributed/executor/worker_host.py``) instead of one actor each;
    ``joins_process_group`` then says whether this role owns their default group.
    """

    worker_base: ClassVar[type[Worker]] = Worker

    def __init__(
        self,
        role: str,
        worker_cls: type[Worker],
        resource_manager: ResourceManager,
        role_plan: RolePlan,
        role_config: RoleConfig,
        pipeline_config: RLVRConfig | None = None,
        hosts: Sequence[HostRef] | None = None,
        joins_process_group: bool | None = None,
    ):
        if not issubclass(worker_cls, self.worker_base):
            raise TypeError(
                f"{type(self).__name__} runs {self.worker_base.__name__} workers, got {worker_cls.__name__}"
            )
        self.role = role
        self.worker_cls = worker_cls
        self.world_size = role_plan.world_size
        self._error: WorkerError | None = None
        # Where each rank runs, for naming a dead one on a run that spans nodes (``_fail``).
        self.nodes = _rank_nodes(resource_manager, role_plan)
        # The run's Ray nodes, for naming one that died under a rank of another (``_fail``).
        self.run_nodes = _run_nodes(resource_manager)
        self.timeouts = pipeline_config.worker_timeouts if pipeline_config else WorkerTimeoutsConfig()
        extra_env = worker_extra_env(pipeline_config, role_config)
        remote_cls = ray.remote(worker_cls) if hosts is None else None
        self.workers: list[ray.actor.ActorHandle | HostedWorker] = []
        added = []
        for rank in range(self.world_size):
            options = resource_manager.worker_options(role_plan, rank)
            options["runtime_env"] = {"env_vars": {**extra_env, **options["runtime_env"]["env_vars"]}}
            # The process's own environment is the whole worker_env: its Ray runtime_env may hold
            # less (``ResourceManager.process_only_env``: an engine on Ray's executor).
            env = {**extra_env, **resource_manager.worker_env(role_plan, rank)}
            args = (role, role_config, pipeline_config, rank, self.world_size, env)
            if hosts is None:
                self.workers.append(remote_cls.options(**options).remote(*args))
            else:
                self.workers.append(HostedWorker(hosts[rank], role, rank))
                added.append(self.workers[-1].add(worker_cls, args))
        self._wait_added(added)
        self.master_addr, self.master_port = self.call(Worker.get_master_address)
        if _joins_process_group(role_config) if joins_process_group is None else joins_process_group:
            self.call(Worker.init_process_group, self.master_addr, self.master_port)
        self.dp_layouts: list[DPRank] = []
        self.refresh_dp_layout()

    # Calls by the worker method's declared mode.
    def call(self, method: Callable[Concatenate[Any, P], Any], *args: P.args, **kwargs: P.kwargs) -> Any:
        """Run ``method`` (a function of the worker class, e.g. ``ModelWorker.generate``) the way its
        ``@register`` mode says, and wait for the gathered result."""
        return self.async_call(method, *args, **kwargs).get()

    def async_call(
        self, method: Callable[Concatenate[Any, P], Any], *args: P.args, **kwargs: P.kwargs
    ) -> AsyncResult[Any]:
        """``call`` that returns at once; ``.get()`` on the result waits and gathers."""
        mode = dispatch_mode(method)
        self._check_alive()
        name = method.__name__
        if mode is Dispatch.RANK_ZERO:
            ref = getattr(self.workers[0], name).remote(*args, **kwargs)
            return AsyncResult(self, [ref], [0], lambda r: r[0], name)
        if mode is Dispatch.DP_COMPUTE:
            return self._dp_compute(name, *args, **kwargs)
        args, kwargs = _share_batches(args, kwargs)
        refs = [getattr(w, name).remote(*args, **kwargs) for w in self.workers]
        return AsyncResult(self, refs, list(range(self.world_size)), list, name)

    def _dp_compute(self, name: str, batch: Batch, *args: Any, **kwargs: Any) -> AsyncResult[Any]:
        layouts = self.dp_layouts
        chunks = [ray.put(chunk) for chunk in split_for_dp(batch, self.dp_size, f"{self.role}.{name}")]
        args, kwargs = _share_batches(args, kwargs)
        refs = [
            getattr(w, name).remote(chunks[layout.dp_rank], *args, **kwargs)
            for w, layout in zip(self.workers, layouts)
        ]
        gather = functools.partial(gather_from_dp, layouts=layouts)
        return AsyncResult(self, refs, list(range(self.world_size)), gather, name)

    # What every worker offers.
    def ping(self) -> list[dict[str, object]]:
        return self.call(Worker.ping)

    def memory_stats(self) -> list[dict[str, float]]:
        """Every rank's peak memory (GiB) since its previous call."""
        return self.call(Worker.memory_stats)

    # Lifecycle.
    def refresh_dp_layout(self) -> None:
        """Re-read every rank's DP layout; call it after the strategies are built.

        Without the re-read the cluster would keep the layout it read before any strategy
        existed (every rank its own DP group) and send different DP chunks to TP/PP peers, whose
        collectives then mismatch: a gloo error on CPU, a hang on NCCL."""
        layouts = [DPRank(*layout) for layout in self.call(Worker.dp_layout)]
        check_dp_layout(layouts, self.role)
        self.dp_layouts = layouts

    @property
    def dp_size(self) -> int:
        return self.dp_layouts[0].dp_size

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S, graceful: bool = True) -> None:
        """Destroy the process groups and end the worker processes (``graceful=False``: kill them).

        The graceful part waits at most ``timeout_s``: after another role failed, this role's
        workers may still be blocked in a collective with the dead ones (a model-update broadcast),
        and their ``shutdown`` call would queue behind it until the collective's own timeout."""
        if graceful and self._error is None and self.workers:
            refs = [worker.shutdown.remote() for worker in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        self._kill(release=True)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self.role}: the workers were stopped after an error ({self._error})")
        if not self.workers:
            raise RuntimeError(f"{self.role}: the workers were shut down")

    def _fail(self, rank: int, exc: RayError) -> WorkerError:
        """Turn a worker's failure into a WorkerError and stop the role, so no rank hangs in a collective.
        A dead host process is named with every member it held (``HostRef.describe``): the role
        whose call saw the death first is only one of them."""
        self._error = WorkerError.from_ray(self.role, rank, exc)
        worker = self.workers[rank] if rank < len(self.workers) else None
        where = None
        if isinstance(worker, HostedWorker) and isinstance(exc, RayActorError) and not worker.host.killed:
            where = worker.host.describe()
        elif isinstance(exc, RayActorError) and self.nodes.get(rank):
            where = f"{self.role} rank {rank} on {self.nodes[rank]}"
        # On a run that spans nodes a rank on a live node often fails first when a peer's node dies
        # (a collective's connection resets, or its process aborts): name the node that went down.
        gone = [n for n in gone_nodes(self.run_nodes) if n != self.nodes.get(rank)] if self.run_nodes else []
        if gone:
            where = f"{where or f'{self.role} rank {rank}'}, after {' and '.join(gone)} went down"
        if where:
            self._error = self._error.on_host(where)
        self._kill()
        return self._error

    def _time_out(self, ranks: list[int], deadline: Deadline) -> WorkerTimeout:
        """Calls on ``ranks`` passed their deadline: stop the role and say which ranks hung."""
        self._error = WorkerTimeout(self.role, ranks, deadline.method, deadline.timeout_s, deadline.key)
        self._kill()
        return self._error

    def _wait_added(self, refs: list[ray.ObjectRef]) -> None:
        """Wait (within ``worker_timeouts.call_s``) for workers built in host processes; an error in
        one's ``__init__`` raises as a worker of its own would
        (``WorkerError: <role> rank <r>: <Type>: in __init__: <msg>``)."""
        if not refs:
            return
        try:
            where = AsyncResult(self, refs, list(range(len(refs))), list, "add").get()
            for worker, found in zip(self.workers, where):
                worker.host.where = found
        except WorkerTimeout:
            raise
        except WorkerError as err:
            if err.exc_type == "ActorDiedError" or err.original_message.startswith("in __init__"):
                raise
            self._error = WorkerError(
                err.role, err.rank, err.exc_type, f"in __init__: {err.original_message}", err.remote_traceback
            )
            raise self._error from None

    def _kill(self, release: bool = False) -> None:
        """End every worker process; ``release``: a shared host ends once all its members let go."""
        for worker in self.workers:
            if isinstance(worker, HostedWorker):
                worker.release() if release else worker.kill()
            else:
                kill_actor(worker)
        self.workers = []


def _rank_nodes(resource_manager: ResourceManager, role_plan: RolePlan) -> dict[int, str]:
    """``{rank: "node 1 (10.0.0.2)"}`` when the run spans nodes (a dead process is then named with
    its node); empty on one node, where the rank says it all."""
    if resource_manager.plan.num_nodes < 2 or role_plan.cpu_only:
        return {}
    return {w.rank: _node_name(resource_manager, w.devices[0]) for w in role_plan.workers}


def _run_nodes(resource_manager: ResourceManager) -> dict[str, str]:
    """``{Ray node id: "node 1 (10.0.0.2)"}`` for every node of a run that spans nodes; empty on one."""
    plan = resource_manager.plan
    if plan.num_nodes < 2:
        return {}
    firsts = [node * plan.devices_per_node for node in range(plan.num_nodes)]  # each node's first device
    return {resource_manager.slots[d].node_id: _node_name(resource_manager, d) for d in firsts}


def _node_name(resource_manager: ResourceManager, device: int) -> str:
    """``"node 1 (10.0.0.2)"``: the plan's node of global device ``device`` and its IP."""
    return (
        f"node {device // resource_manager.plan.devices_per_node} ({resource_manager.slots[device].node_ip})"
    )


# Seconds to wait for a node's raylet to accept a connection before calling the node gone.
RAYLET_PROBE_S = 1.0


def gone_nodes(run_nodes: dict[str, str]) -> list[str]:
    """The names of ``run_nodes`` that Ray lists as dead, or whose raylet no longer accepts
    connections (Ray takes many seconds to mark a killed node dead; its raylet's port closes at once)."""
    try:
        table = {node["NodeID"]: node for node in ray.nodes()}
    except Exception:  # noqa: BLE001 - the GCS itself may be gone; then nothing can be named
        return []
    gone = []
    for node_id, name in run_nodes.items():
        node = table.get(node_id)
        if (
            node is None
            or not node.get("Alive")
            or not answers(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}", RAYLET_PROBE_S)
        ):
            gone.append(name)
    return gone


def _share_batches(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Put Batch arguments into Ray's object store once instead of once per worker."""
    args = [ray.put(a) if isinstance(a, Batch) else a for a in args]
    kwargs = {k: ray.put(v) if isinstance(v, Batch) else v for k, v in kwargs.items()}
    return args, kwargs


def _joins_process_group(role_config: RoleConfig) -> bool:
    """Whether the role's workers share a torch.distributed default group (see ``StrategySpec``)."""
    args = role_config.strategy_args
    return args is None or get_strategy_spec(args.strategy_name).role_process_group
