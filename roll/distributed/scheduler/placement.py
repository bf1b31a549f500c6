"""Placement planning as pure functions: device mappings -> nodes, workers and shared devices.

>>> plan = plan_placement(config)
>>> print(format_plan(plan))

Device ids are global; device ``d`` lives on node ``d // num_gpus_per_node`` at local slot
``d % num_gpus_per_node``. A worker owns ``devices_per_worker`` consecutive ids of its role's
mapping (vLLM/SGLang engines with TP > 1 own several); other strategies own one device per worker.

A worker's devices sit on one node, except a vLLM engine on Ray's executor
(``distributed_executor_backend: ray``), whose devices may fill several whole nodes: its GPU workers
are Ray actors, one per device, so the nodes it spans share one placement group (``node_groups``).
"""

from __future__ import annotations

from dataclasses import dataclass

from roll.configs.device_mapping import format_device_ids
from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RoleConfig, strategy_options
from roll.configs.strategy_configs import ParallelSizes


@dataclass(frozen=True)
class WorkerPlacement:
    rank: int
    node: int
    devices: tuple[int, ...]
    local_devices: tuple[int, ...]


@dataclass(frozen=True)
class RolePlan:
    role: str
    strategy_name: str | None
    devices: tuple[int, ...]
    workers: tuple[WorkerPlacement, ...]
    parallel: ParallelSizes
    cpu_only: bool = False
    # The workers run an engine whose GPU workers are Ray actors in the worker's placement group
    # (vLLM ``distributed_executor_backend: ray``); the worker itself holds no GPU.
    workers_on_ray: bool = False

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({w.node for w in self.workers}))


@dataclass(frozen=True)
class PlacementPlan:
    num_nodes: int
    devices_per_node: int
    roles: dict[str, RolePlan]
    # Each entry: roles that time-share the listed devices (colocated).
    shared: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]
    # Nodes that share one placement group, in order: each node alone, except the nodes of an
    # engine that spans them (all its devices in one group, where vLLM's Ray executor finds them).
    node_groups: tuple[tuple[int, ...], ...] = ()

    def roles_on_device(self, device: int) -> list[str]:
        return [name for name, plan in self.roles.items() if device in plan.devices]


def plan_role(name: str, role: RoleConfig, devices_per_node: int) -> RolePlan:
    """Workers of one role. Raises ConfigError when a worker's devices would span nodes."""
    args = role.strategy_args
    if role.device_mapping is None:
        world = role.world_size or 1
        workers = tuple(WorkerPlacement(rank=r, node=0, devices=(), local_devices=()) for r in range(world))
        return RolePlan(
            name, args.strategy_name if args else None, (), workers, ParallelSizes(dp=world), cpu_only=True
        )
    typed = strategy_options(role)
    per_worker = getattr(typed, "devices_per_worker", 1)
    devices = tuple(role.device_mapping)
    if len(devices) % per_worker:
        raise ConfigError(
            f"{name}.device_mapping",
            f"{len(devices)} devices do not split into workers of {per_worker} devices",
        )
    workers = []
    for rank in range(len(devices) // per_worker):
        own = devices[rank * per_worker : (rank + 1) * per_worker]
        nodes = sorted({d // devices_per_node for d in own})
        if len(nodes) > 1:
            check_spanning_worker(name, typed, rank, own, devices_per_node)
        workers.append(
            WorkerPlacement(
                rank=rank,
                node=own[0] // devices_per_node,
                devices=own,
                local_devices=tuple(d % devices_per_node for d in own),
            )
        )
    parallel = typed.parallel_sizes(len(devices)) if typed is not None else ParallelSizes(dp=len(workers))
    on_ray = bool(getattr(typed, "workers_on_ray", False))
    return RolePlan(
        name, args.strategy_name if args else None, devices, tuple(workers), parallel, workers_on_ray=on_ray
    )


def check_spanning_worker(
    name: str, typed: object, rank: int, own: tuple[int, ...], devices_per_node: int
) -> None:
    """A worker whose devices lie on several nodes: only an engine on Ray's executor may, and only
    over whole nodes (each TP x PP group of vLLM then keeps to its nodes' order); a ConfigError
    naming the key to change otherwise."""
    nodes = sorted({d // devices_per_node for d in own})
    where = f"worker {rank} would span nodes {nodes} (devices {format_device_ids(list(own))})"
    if not hasattr(typed, "workers_on_ray"):
        raise ConfigError(
            f"{name}.device_mapping",
            f"{where}; one engine's devices must sit on one node of {devices_per_node} devices",
        )
    if not typed.workers_on_ray:
        raise ConfigError(
            f"{name}.strategy_args.strategy_config.distributed_executor_backend",
            f"is {typed.distributed_executor_backend!r} but {where}: an engine across nodes runs on "
            f"vLLM's Ray executor; set it to 'ray', or map each engine within one node of "
            f"{devices_per_node} devices",
        )
    partial = [n for n in nodes if sum(1 for d in own if d // devices_per_node == n) != devices_per_node]
    if partial:
        raise ConfigError(
            f"{name}.device_mapping",
            f"{where} but does not fill node(s) {partial}: an engine across nodes takes whole nodes of "
            f"{devices_per_node} devices (tensor_parallel_size a multiple of {devices_per_node}), or "
            "keeps within one node",
        )


def plan_placement(config: RLVRConfig) -> PlacementPlan:
    per_node = config.num_gpus_per_node
    roles = {name: plan_role(name, role, per_node) for name, role in config.roles().items()}
    used = sorted({d for plan in roles.values() for d in plan.devices})
    num_nodes = (used[-1] // per_node + 1) if used else 1
    if config.num_nodes is not None:
        num_nodes = config.num_nodes
    check_ray_engines_own_devices(roles)
    return PlacementPlan(
        num_nodes, per_node, roles, _shared_groups(roles), node_groups(roles, num_nodes, per_node)
    )


# The role whose ranks send model updates; a colocated link maps its buffers by CUDA IPC.
SENDER_ROLE = "actor_train"


def check_ray_engines_own_devices(roles: dict[str, RolePlan]) -> None:
    """An engine on Ray's executor shares no device with the model update's sender: a colocated
    link hands the engine the sender's buffer by CUDA IPC on that device, which its GPU workers
    (Ray actors that see their node's GPUs by physical id, some on other nodes) cannot map."""
    sender = roles.get(SENDER_ROLE)
    if sender is None:
        return
    for name, plan in roles.items():
        shared = sorted(set(plan.devices) & set(sender.devices)) if plan.workers_on_ray else []
        if shared:
            raise ConfigError(
                f"{name}.device_mapping",
                f"shares devices {format_device_ids(shared)} with {SENDER_ROLE}, but its engine runs on "
                "distributed_executor_backend 'ray', whose GPU workers cannot map a colocated model "
                f"update; give {name} devices of its own, or use 'mp' within one node",
            )


def node_groups(roles: dict[str, RolePlan], num_nodes: int, per_node: int) -> tuple[tuple[int, ...], ...]:
    """Nodes that share a placement group: every node alone, merged with the other nodes of any
    worker whose devices span them (``((0,), (1,), (2, 3))`` for an engine on nodes 2 and 3)."""
    group_of = {node: frozenset({node}) for node in range(num_nodes)}
    for plan in roles.values():
        for worker in plan.workers:
            nodes = {d // per_node for d in worker.devices}
            if len(nodes) < 2:
                continue
            merged = frozenset().union(*(group_of.get(n, frozenset({n})) for n in nodes))
            for node in merged:
                group_of[node] = merged
    return tuple(sorted({tuple(sorted(group)) for group in group_of.values()}))


def _shared_groups(roles: dict[str, RolePlan]) -> tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]:
    by_roles: dict[tuple[str, ...], list[int]] = {}
    devices = sorted({d for plan in roles.values() for d in plan.devices})
    for d in devices:
        owners = tuple(name for name, plan in roles.items() if d in plan.devices)
        if len(owners) > 1:
            by_roles.setdefault(owners, []).append(d)
    return tuple((owners, tuple(ds)) for owners, ds in by_roles.items())


def format_plan(plan: PlacementPlan, device_kind: str = "GPU") -> str:
    lines = [
        f"Placement plan: {plan.num_nodes} node(s) x {plan.devices_per_node} {device_kind}(s) per node",
        f"{'role':<22} {'strategy':<15} {'world':>5}  {'parallel':<30} devices by node",
    ]
    for name, rp in plan.roles.items():
        if rp.cpu_only:
            where = f"CPU only ({rp.world_size} worker(s))"
        else:
            where = "; ".join(
                f"node{n}: {format_device_ids([d for d in rp.devices if d // plan.devices_per_node == n])}"
                for n in rp.nodes
            )
        lines.append(
            f"{name:<22} {rp.strategy_name or '-':<15} {rp.world_size:>5}  {rp.parallel.describe():<30} {where}"
        )
    lines += _engines_on_ray(plan)
    if plan.shared:
        lines.append("Colocated (time-shared devices):")
        for owners, devices in plan.shared:
            lines.append(f"  {' + '.join(owners)} on devices {format_device_ids(list(devices))}")
    else:
        lines.append("Colocated: none (every role has its own devices)")
    return "\n".join(lines)


def _engines_on_ray(plan: PlacementPlan) -> list[str]:
    """Where each engine on Ray's executor has its devices (one Ray GPU worker per device, in this
    order), and the placement group that holds them."""
    lines = []
    for name, rp in plan.roles.items():
        if not rp.workers_on_ray:
            continue
        if not lines:
            lines.append(
                "Engines on Ray's executor (one GPU worker per device, in this order; no GPU for the worker):"
            )
        for w in rp.workers:
            nodes = sorted({d // plan.devices_per_node for d in w.devices})
            where = "; ".join(
                f"node{n}: {format_device_ids([d for d in w.devices if d // plan.devices_per_node == n])}"
                for n in nodes
            )
            group = next((g for g in plan.node_groups if nodes[0] in g), (nodes[0],))
            lines.append(
                f"  {name} rank {w.rank}: {where} (placement group of node{'s' if len(group) > 1 else ''} "
                f"{','.join(map(str, group))})"
            )
    return lines
