"""Ray, the device reservation, the host processes and every role's workers, started on a thread
while the driver checks the config; and the host processes of a run.

Starting Ray takes seconds of waiting on its daemons, starting the workers seconds of process
starts and imports (torch, megatron-core, the engine), and the driver's pre-launch checks seconds
of importing torch and transformers (15-20 s on a fresh GPU host): the three overlap. The
launcher starts them as soon as the config is loaded and ``start.start_clusters`` takes them::

    prestart(config)                 # returns at once; Ray, the reservation, hosts, workers start
    check_before_launch(config)      # meanwhile (a ConfigError here: discard_prestart() stops them)
    run_pipeline(config)             # start_clusters takes them (take_prestart), or starts its own
    discard_prestart()               # in the launcher's finally: stops a prestart nobody took

The workers are built from the config as loaded: the checks read it and change nothing
(``tests/test_startup.py``), so they see what they would have seen after them. Their
``initialize`` (model load, engine start) waits for ``start_clusters``, after the checks passed.

Host processes (``start_hosts``): on CPU slots the colocated roles of a slot share one process
(``roll/distributed/scheduler/hosting.py``); rule rewards ride along in the first hosts.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from roll.configs.pipeline_config import RLVRConfig
from roll.core.roles import Role
from roll.distributed.scheduler.placement import PlacementPlan, plan_placement
from roll.distributed.scheduler.ray_start import reinstall_signal_handlers

if TYPE_CHECKING:
    from roll.distributed.executor.worker_host import HostRef
    from roll.distributed.scheduler.cluster import Cluster
    from roll.distributed.scheduler.resource_manager import ResourceManager

# Per hosted role: its host by rank, and whether it joins its process group (the host's group owner).
Hosted = dict[str, tuple[list["HostRef"], bool]]


def start_hosts(config: RLVRConfig, plan: PlacementPlan, rm: ResourceManager) -> tuple[Hosted, list[HostRef]]:
    """Start the host processes ``plan_hosts`` plans for the run (none on GPUs); returns the hosted
    roles and every host (``RLVRRun.hosts``: shutdown kills them whatever became of their members)."""
    from roll.distributed.executor.worker_host import start_host
    from roll.distributed.scheduler.hosting import plan_hosts

    roles = config.roles()
    hosted: Hosted = {}
    refs = []
    for host in plan_hosts(plan, roles, rm.device, riders=rule_reward_roles(config)):
        first = plan.roles[host.roles[0]]
        options = rm.worker_options(first, host.rank)
        share = options["num_gpus"] * len(host.roles)  # each member role's share of the slot
        options["num_gpus"] = min(1.0, int(share * 10_000 + 0.5) / 10_000)
        env = {
            **config.system_envs,
            **roles[host.roles[0]].system_envs,
            **options["runtime_env"]["env_vars"],
            "RANK": str(host.rank),
            "WORLD_SIZE": str(first.world_size),
        }
        ref = start_host(host.members, env, options, preload_modules(config, [r for r, _ in host.members]))
        refs.append(ref)
        for role, rank in host.members:
            ranks, _ = hosted.setdefault(
                role, ([None] * plan.roles[role].world_size, role == host.group_owner)
            )
            ranks[rank] = ref
    return hosted, refs


def start_workers(
    config: RLVRConfig,
    plan: PlacementPlan,
    resources: ResourceManager,
    hosted: Hosted | None,
    clusters: dict[str, Cluster],
) -> None:
    """One cluster per role into ``clusters`` (config order), built on threads: each blocks until
    its ranks answer and have joined their process group, and Ray starts all the processes
    meanwhile. ``hosted``: the roles whose workers live in host processes (``prestart.start_hosts``),
    with their hosts by rank. A role that fails to start raises once the others are in
    ``clusters``, so the caller's shutdown stops them."""
    from roll.pipeline.workers.classes import role_classes

    roles = config.roles()
    hosted = hosted or {}

    def start(name: str) -> Cluster:
        cluster_cls, worker_cls = role_classes(name)
        extra = {"hosts": hosted[name][0], "joins_process_group": hosted[name][1]} if name in hosted else {}
        return cluster_cls(name, worker_cls, resources, plan.roles[name], roles[name], config, **extra)

    pool = ThreadPoolExecutor(len(roles), thread_name_prefix="start-workers")
    futures: dict[str, Future] = {name: pool.submit(start, name) for name in roles}
    error: BaseException | None = None
    try:
        for name, future in futures.items():  # config order, whatever order they finish in
            try:
                clusters[name] = future.result()
            except Exception as exc:  # noqa: BLE001 - the others are kept for shutdown, then it raises
                error = error or exc
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if error is not None:
        raise error


def preload_modules(config: RLVRConfig, names: list[str]) -> tuple[str, ...]:
    """The modules a host imports as it starts: its members' worker classes and strategies (while
    the driver is still checking the config, when the launcher prestarts)."""
    from roll.configs.strategies import get_strategy_spec
    from roll.pipeline.workers.classes import role_classes

    roles = config.roles()
    modules = []
    for name in names:
        modules.append(role_classes(name)[1].__module__)
        args = roles[name].strategy_args
        if args is not None:
            modules.append(get_strategy_spec(args.strategy_name).target.split(":")[0])
        elif Role.parse(name).is_reward:
            modules.append("roll.pipeline.rewards.scoring")
    return tuple(dict.fromkeys(modules))


def rule_reward_roles(config: RLVRConfig) -> list[str]:
    """Reward roles that may ride in a host process: rule rewards (they score in subprocesses of
    their own and touch nothing process-wide) without ``system_envs`` of their own."""
    from roll.pipeline.rewards.registry import get_reward_spec

    return [
        Role.reward(name).key
        for name, reward in config.rewards.items()
        if get_reward_spec(reward.reward_fn).kind != "model" and not reward.system_envs
    ]


@dataclass
class Early:
    """What a prestart started for a run: the reservation, the host processes and the role
    clusters that came up (config order; a role whose start failed is missing and ``error`` says
    why, so the run's shutdown still stops the others)."""

    resources: ResourceManager
    hosts: list[HostRef]
    clusters: dict[str, Cluster] = field(default_factory=dict)
    error: BaseException | None = None
    workers_done: threading.Event = field(default_factory=threading.Event)

    def wait_workers(self) -> dict[str, Cluster]:
        """The clusters (waiting for their start); the first role that failed to start raises
        here, after the caller could take the others from ``clusters`` for its shutdown."""
        self.workers_done.wait()
        if self.error is not None:
            raise self.error
        return self.clusters


class _Prestart:
    def __init__(self, config: RLVRConfig):
        self.config = config
        self.early: Early | None = None
        self.error: BaseException | None = None  # Ray, the reservation or the hosts did not start
        self.started = threading.Event()  # Ray, the reservation and the hosts are up (or failed)
        # Ray's daemons die with the *thread* that started them (PR_SET_PDEATHSIG), so the thread
        # lives on until Ray is shut down (``_stop``) or the process ends.
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, name="roll-prestart", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from roll.distributed.scheduler.resource_manager import ResourceManager

        try:
            plan = plan_placement(self.config)
            rm = ResourceManager(plan, self.config.device)
            hosted, hosts = start_hosts(self.config, plan, rm)
            self.early = Early(rm, hosts)
        except BaseException as exc:  # noqa: BLE001 - raised again where the run takes it
            self.error = exc
        self.started.set()
        if self.early is not None:
            try:
                start_workers(self.config, plan, rm, hosted, self.early.clusters)
            except BaseException as exc:  # noqa: BLE001 - raised again where the run takes it
                self.early.error = exc
            self.early.workers_done.set()
        self.release.wait()

    def take(self) -> Early:
        """The reservation and hosts, once up (an error there raises); ``Early.wait_workers``
        then waits for the clusters."""
        self.started.wait()
        if self.error is not None:
            raise self.error
        assert self.early is not None
        return self.early


_pending: _Prestart | None = None


def prestart(config: RLVRConfig) -> None:
    """Start Ray, reserve the devices and start the host processes and the workers of ``config``
    on a thread."""
    global _pending
    discard_prestart()
    _pending = _Prestart(config)


def take_prestart(config: RLVRConfig) -> Early | None:
    """What ``prestart(config)`` started, once Ray, the reservation and the hosts are up (an error
    there raises here), or None when nothing was started for this config object. The workers may
    still be starting: ``Early.wait_workers`` waits for them."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return None
    if pending.config is not config:
        _stop(pending)
        return None
    try:
        return pending.take()
    finally:
        reinstall_signal_handlers()  # Ray's core worker set C-level ones from the prestart thread


def discard_prestart() -> None:
    """Stop what a prestart started and nobody took (a ConfigError after ``prestart``)."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        _stop(pending)


def _stop(pending: _Prestart) -> None:
    import ray

    from roll.distributed.scheduler.ray_shutdown import shutdown_ray

    pending.started.wait()
    if pending.early is not None:
        pending.early.workers_done.wait()  # the workers' start is not cut off midway: Ray's shutdown stops them
    if pending.early is not None and ray.is_initialized():
        for host in pending.early.hosts:
            host.kill()
        pending.early.resources.destroy(timeout_s=1.0)
    shutdown_ray()
    pending.release.set()
