"""Placement planning as pure functions: device mappings -> nodes, workers and shared devices.

>>> plan = plan_placement(config)
>>> print(format_plan(plan))

Device ids are global; device ``d`` lives on node ``d // num_gpus_per_node`` at local slot
``d % num_gpus_per_node``. A worker owns ``devices_per_worker`` consecutive ids of its role's
mapping (vLLM/SGLang engines with TP > 1 own several); other strategies own one device per worker.
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
        nodes = {d // devices_per_node for d in own}
        if len(nodes) > 1:
            raise ConfigError(
                f"{name}.device_mapping",
                f"worker {rank} would span nodes {sorted(nodes)} (devices {list(own)}); "
                f"one engine's devices must sit on one node of {devices_per_node} devices",
            )
        workers.append(
            WorkerPlacement(
                rank=rank,
                node=own[0] // devices_per_node,
                devices=own,
                local_devices=tuple(d % devices_per_node for d in own),
            )
        )
    parallel = typed.parallel_sizes(len(devices)) if typed is not None else ParallelSizes(dp=len(workers))
    return RolePlan(name, args.strategy_name if args else None, devices, tuple(workers), parallel)


def plan_placement(config: RLVRConfig) -> PlacementPlan:
    per_node = config.num_gpus_per_node
    roles = {name: plan_role(name, role, per_node) for name, role in config.roles().items()}
    used = sorted({d for plan in roles.values() for d in plan.devices})
    num_nodes = (used[-1] // per_node + 1) if used else 1
    if config.num_nodes is not None:
        num_nodes = config.num_nodes
    return PlacementPlan(num_nodes, per_node, roles, _shared_groups(roles))


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
    if plan.shared:
        lines.append("Colocated (time-shared devices):")
        for owners, devices in plan.shared:
            lines.append(f"  {' + '.join(owners)} on devices {format_device_ids(list(devices))}")
    else:
        lines.append("Colocated: none (every role has its own devices)")
    return "\n".join(lines)
