"""Reserve the plan's devices on a Ray cluster and say where each worker runs.

>>> plan = plan_placement(config)
>>> rm = ResourceManager(plan, config.device)        # starts or joins Ray, reserves every device
>>> options = rm.worker_options(plan.roles["actor_train"], rank=3)
>>> actor = ray.remote(MyWorker).options(**options).remote(...)
>>> rm.destroy()

How device ids map onto Ray: the plan's global device ``d`` lives on node ``d // devices_per_node``
at slot ``d % devices_per_node``. Each node gets one placement group of ``devices_per_node``
one-GPU bundles packed onto one machine (STRICT_PACK), so bundle ``i`` of group ``n`` *is* device
``n * devices_per_node + i``. A tiny probe task on each bundle learns its node IP and physical GPU id,
which become the workers' ``CUDA_VISIBLE_DEVICES`` (all of a worker's devices, for TP engines).

Colocation: roles that list the same device each ask for ``1/k`` of that bundle's GPU (k roles share
it), so Ray places them all on the same GPU; they time-share it by offloading.

Engines on Ray's executor (``RolePlan.workers_on_ray``, vLLM ``distributed_executor_backend: ray``):
the nodes an engine spans share one placement group (``plan.node_groups``), its bundles pinned to
one machine per node by Ray's node-id label; the worker sits on its first device's bundle with no
GPU and ``placement_group_capture_child_tasks``, and vLLM starts one GPU worker per device on the
bundles listed in ``ROLL_ENGINE_BUNDLES``, each taking the worker's ``1/k`` share
(``ROLL_ENGINE_DEVICE_SHARE``); ``ROLL_ENGINE_NODES`` is how many nodes those devices span. Its
``CUDA_VISIBLE_DEVICES`` (its first device) stays out of its Ray runtime_env, which vLLM hands on to
those GPU workers: they must see their node's GPUs.

CPU mode (``device: cpu``, or ``auto`` without CUDA): a private local Ray is started with one fake
GPU per device slot, so the same placement code runs and device ids are CPU slots.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roll.configs.device_mapping import format_device_ids
from roll.configs.errors import ConfigError
from roll.distributed.scheduler.errors import PlacementError
from roll.distributed.scheduler.machines import GroupLayout, choose_machines, node_selector
from roll.distributed.scheduler.placement import PlacementPlan, RolePlan
from roll.distributed.scheduler.ray_shutdown import run_with_deadline
from roll.distributed.scheduler.ray_start import LOOPBACK, NOSET_CUDA, gcs_reachable, init_ray


@dataclass(frozen=True)
class DeviceSlot:
    """What the probe learned about one bundle (one device id of the plan)."""

    node_ip: str
    node_id: str
    # Ray's GPU id of the bundle: the physical CUDA id on a GPU node, a slot number on CPU.
    gpu_id: str
    # CPU cores of that node, to size OMP_NUM_THREADS.
    num_cpus: int


def check_capacity(plan: PlacementPlan, nodes: list[tuple[str, float]], device: str = "cuda") -> None:
    """Raise a ConfigError unless ``nodes`` ([(ip, GPUs)], alive ones) hold ``plan.num_nodes`` groups of
    ``plan.devices_per_node`` GPUs, each group on one machine."""
    per_node = plan.devices_per_node
    fits = sum(int(gpus // per_node) for _, gpus in nodes)
    if fits >= plan.num_nodes:
        return
    have = ", ".join(f"{ip}: {gpus:g}" for ip, gpus in nodes) or "no nodes"
    hint = " (on CPU, start each node with `ray start --num-gpus=<device slots>`)" if device == "cpu" else ""
    largest = max((gpus for _, gpus in nodes), default=0)
    if largest < per_node:
        raise ConfigError(
            "num_gpus_per_node",
            f"is {per_node} but no node of the Ray cluster has that many GPUs (GPUs by node: {have}); "
            f"set it to the GPU count of one node{hint}",
        )
    raise ConfigError(
        "device_mapping",
        f"the mappings need {plan.num_nodes} node(s) x {per_node} GPUs but the Ray cluster has room for "
        f"{fits} (GPUs by node: {have}); add nodes with `ray start --address=<head>:6379` or map fewer devices{hint}",
    )


@ray.remote(num_cpus=0, max_calls=0)
def _probe_slot() -> DeviceSlot:
    ctx = ray.get_runtime_context()
    gpu_ids = ctx.get_accelerator_ids()["GPU"]
    return DeviceSlot(
        ray.util.get_node_ip_address(), ctx.get_node_id(), gpu_ids[0], len(os.sched_getaffinity(0))
    )


class ResourceManager:
    """Reserves every device of a ``PlacementPlan`` and gives each worker its Ray options.

    See the module docstring for how device ids map to nodes and bundles.
    """

    def __init__(
        self, plan: PlacementPlan, device: str = "auto", log_to_driver: bool = True, timeout_s: float = 300
    ):
        self.plan = plan
        # When each part of the start was done (epoch seconds): the start-up timeline's driver marks.
        self.marks: dict[str, float] = {}
        private = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
        self.device = init_ray(plan, device, log_to_driver)
        self.marks["ray"] = time.time()
        nodes = [(n["NodeManagerAddress"], n["Resources"].get("GPU", 0.0)) for n in ray.nodes() if n["Alive"]]
        check_capacity(plan, nodes, self.device)
        self.layout = GroupLayout.of(plan)
        self.placement_groups = self._reserve(timeout_s)
        self.marks["reserved"] = time.time()
        # A private CPU Ray started here is this machine, its slots numbered in bundle order: no
        # probe tasks (each one a Python worker process to start before any worker can).
        self.slots = self._local_slots() if private and self.device == "cpu" else self._probe()
        self.marks["probed"] = time.time()

    def _reserve(self, timeout_s: float) -> list[PlacementGroup]:
        """One placement group per node group of the plan: a node alone is one machine's
        ``devices_per_node`` bundles (STRICT_PACK); the nodes of an engine that spans them are
        reserved next, each node's bundles pinned to a machine the single nodes left free."""
        per_node = self.plan.devices_per_node
        groups: list[PlacementGroup | None] = [None] * len(self.layout.groups)
        for index, nodes in enumerate(self.layout.groups):
            if len(nodes) == 1:
                groups[index] = placement_group([{"GPU": 1}] * per_node, strategy="STRICT_PACK")
        deadline = time.monotonic() + timeout_s
        self._wait_ready([g for g in groups if g is not None], groups, deadline)
        spanning = [i for i, nodes in enumerate(self.layout.groups) if len(nodes) > 1]
        if spanning:
            machines = choose_machines(
                [self.layout.groups[i] for i in spanning], _free_machine_slots(groups, per_node), per_node
            )
            for index, by_node in zip(spanning, machines):
                selector = node_selector(by_node, per_node)
                groups[index] = placement_group(
                    [{"GPU": 1}] * len(selector), strategy="PACK", bundle_label_selector=selector
                )
            self._wait_ready([groups[i] for i in spanning], groups, deadline)
        return groups

    def _wait_ready(self, waiting: list[PlacementGroup], groups: list, deadline: float) -> None:
        timeout_s = max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait([g.ready() for g in waiting], num_returns=len(waiting), timeout=timeout_s)
        if len(ready) == len(waiting):
            return
        for group in groups:
            if group is not None:
                remove_placement_group(group)
        raise PlacementError(
            f"could not reserve {self.plan.num_nodes} node(s) x {self.plan.devices_per_node} GPUs in time; "
            f"free GPUs now: {ray.available_resources().get('GPU', 0):g} "
            "(another job may hold them: see `ray status`)"
        )

    def _probe(self) -> list[DeviceSlot]:
        refs = [
            _probe_slot.options(num_gpus=0.01, scheduling_strategy=self._bundle(device)).remote()
            for device in range(self.plan.num_nodes * self.plan.devices_per_node)
        ]
        return ray.get(refs)

    def _local_slots(self) -> list[DeviceSlot]:
        node_id = ray.get_runtime_context().get_node_id()
        cpus = len(os.sched_getaffinity(0))
        count = self.plan.num_nodes * self.plan.devices_per_node
        return [DeviceSlot(LOOPBACK, node_id, str(device), cpus) for device in range(count)]

    def _bundle(self, device: int, capture: bool = False) -> PlacementGroupSchedulingStrategy:
        """The bundle of global ``device``; ``capture``: what the actor starts lands in its group too."""
        group, bundle = self.layout.bundle(device)
        return PlacementGroupSchedulingStrategy(
            self.placement_groups[group],
            placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=capture,
        )

    def worker_env(self, role_plan: RolePlan, rank: int) -> dict[str, str]:
        """Environment of one worker: its devices, device kind, local rank and thread count."""
        worker = role_plan.workers[rank]
        env = {NOSET_CUDA: "1", "ROLL_DEVICE_IDS": ",".join(map(str, worker.devices))}
        if role_plan.cpu_only:
            return env | {
                "ROLL_DEVICE": "cpu",
                "CUDA_VISIBLE_DEVICES": "",
                "LOCAL_RANK": str(rank),
                "OMP_NUM_THREADS": "1",
            }
        slots = [self.slots[d] for d in worker.devices]
        local_rank = sum(1 for w in role_plan.workers[:rank] if w.node == worker.node)
        threads = max(1, slots[0].num_cpus // self.plan.devices_per_node)
        if role_plan.workers_on_ray:  # the engine's GPU workers take the devices; the worker its first
            slots = slots[:1]
            env |= {
                "ROLL_ENGINE_BUNDLES": ",".join(str(self.layout.bundle(d)[1]) for d in worker.devices),
                "ROLL_ENGINE_DEVICE_SHARE": str(self._share(role_plan, rank)),
                "ROLL_ENGINE_NODES": str(len({d // self.plan.devices_per_node for d in worker.devices})),
            }
        return env | {
            "ROLL_DEVICE": self.device,
            "CUDA_VISIBLE_DEVICES": ",".join(s.gpu_id for s in slots) if self.device == "cuda" else "",
            "LOCAL_RANK": str(local_rank),
            "OMP_NUM_THREADS": str(threads),
        }

    def process_only_env(self, role_plan: RolePlan) -> tuple[str, ...]:
        """Variables of ``worker_env`` that a worker sets in its own process but that stay out of
        its Ray runtime_env: vLLM hands an engine worker's runtime_env on to the GPU workers it
        starts on Ray, which must see their node's GPUs (they pick theirs by physical id)."""
        return ("CUDA_VISIBLE_DEVICES",) if role_plan.workers_on_ray else ()

    def _share(self, role_plan: RolePlan, rank: int, num_roles_sharing: int | None = None) -> float:
        devices = role_plan.workers[rank].devices
        sharing = num_roles_sharing or max(len(self.plan.roles_on_device(d)) for d in devices)
        return int(10_000 / sharing) / 10_000  # Ray counts resources in units of 1e-4

    def worker_options(
        self, role_plan: RolePlan, rank: int, num_roles_sharing: int | None = None
    ) -> dict[str, Any]:
        """Ray actor options for worker ``rank``: pinned to the bundle of its first device with a
        1/k share of that GPU (k = roles on its devices unless given), no CPU reservation, and its
        environment (less ``process_only_env``). CPU-only roles get plain actors that are not bound
        to a bundle. An engine on Ray's executor takes no GPU and captures what it starts (vLLM's
        GPU workers take the shares) in its placement group."""
        hidden = self.process_only_env(role_plan)
        env = {k: v for k, v in self.worker_env(role_plan, rank).items() if k not in hidden}
        options = {"num_cpus": 0, "runtime_env": {"env_vars": env}}
        if role_plan.cpu_only:
            return options
        first = role_plan.workers[rank].devices[0]
        if role_plan.workers_on_ray:
            return options | {"num_gpus": 0, "scheduling_strategy": self._bundle(first, capture=True)}
        share = self._share(role_plan, rank, num_roles_sharing)
        return options | {"num_gpus": share, "scheduling_strategy": self._bundle(first)}

    def check_worker_nodes(self, role_plan: RolePlan, node_ids: list[str]) -> None:
        """Each rank of ``role_plan`` reported the Ray node it runs on (``node_ids``, by rank): raise
        PlacementError unless that is the node its devices were reserved on."""
        for worker, node_id in zip(role_plan.workers, node_ids):
            want = self.slots[worker.devices[0]]
            if node_id != want.node_id:
                raise PlacementError(
                    f"{role_plan.role} rank {worker.rank} runs on Ray node {node_id} but its devices "
                    f"{list(worker.devices)} were reserved on node {worker.node} ({want.node_ip}, Ray node "
                    f"{want.node_id})"
                )

    def name_node(self, node_id: str) -> str:
        """``node 1 (10.0.0.2)`` for a Ray node of the plan, ``Ray node <id>`` for any other (a
        CPU-only role may run on a node that holds no reserved devices)."""
        per_node = self.plan.devices_per_node
        for node in range(self.plan.num_nodes):
            slot = self.slots[node * per_node]
            if slot.node_id == node_id:
                return f"node {node} ({slot.node_ip})"
        return f"Ray node {node_id}"

    def describe(self, roles: dict[str, RolePlan] | None = None) -> str:
        """One line per node: its IP, Ray node id and the Ray GPU ids of its device slots, and the
        ranks of each of ``roles`` (default: the plan's) that run there."""
        per_node = self.plan.devices_per_node
        roles = self.plan.roles if roles is None else roles
        lines = []
        for node in range(self.plan.num_nodes):
            slots = self.slots[node * per_node : (node + 1) * per_node]
            held = [
                f"{name} ranks {format_device_ids([w.rank for w in rp.workers if w.node == node])}"
                for name, rp in roles.items()
                if not rp.cpu_only and node in rp.nodes
            ]
            lines.append(
                f"node {node}: {slots[0].node_ip} (Ray node {slots[0].node_id}) {self.device} ids "
                f"{','.join(s.gpu_id for s in slots)}: {'; '.join(held) or 'no workers'}"
            )
        return "\n".join(lines)

    def destroy(self, timeout_s: float = 30.0) -> None:
        """Give the reserved devices back to Ray, waiting at most ``timeout_s``. Nothing to give
        back when Ray itself is gone, e.g. after a SIGTERM to the whole process group: the call
        would block on the dead GCS, and on one still dying (60 s seen on CPU) past the check."""
        groups, self.placement_groups = self.placement_groups, []
        if not groups or not gcs_reachable():
            return
        removed = run_with_deadline(
            lambda: [remove_placement_group(group) for group in groups], timeout_s, "roll-pg-remove"
        )
        if not removed:
            logging.getLogger("roll").debug(
                "placement groups not removed within %g s; leaving them", timeout_s
            )


def _free_machine_slots(groups: list[PlacementGroup | None], per_node: int) -> dict[str, int]:
    """Whole nodes of ``per_node`` GPUs each alive Ray node still has once ``groups`` (the ones
    reserved so far) are taken, by Ray node id, in ``ray.nodes()`` order."""
    taken: dict[str, int] = {}
    for group in groups:
        if group is not None:
            for node_id in placement_group_table(group)["bundles_to_node_id"].values():
                taken[node_id] = taken.get(node_id, 0) + 1
    return {
        n["NodeID"]: int((n["Resources"].get("GPU", 0.0) - taken.get(n["NodeID"], 0)) // per_node)
        for n in ray.nodes()
        if n["Alive"]
    }
