"""Which workers share one process on CPU slots: a pure plan over the placement plan.

Every worker process imports torch and transformers, which is most of a CPU run's start-up
(several CPU seconds per process; the default example had 7 of them on 2 cores). On CPU slots the
colocated roles of one slot therefore live in one *host* process (``WorkerHost``), one per slot,
instead of one process per role and rank::

    hosts = plan_hosts(plan, config.roles(), "cpu", riders=["rewards.math"])
    # [HostPlan(members=(("actor_train", 0), ("actor_infer", 0), ("reference", 0), ("rewards.math", 0)), ...),
    #  HostPlan(members=(("actor_train", 1), ("actor_infer", 1), ("reference", 1)), ...)]

A role joins a host when (all must hold; otherwise it keeps one process per rank, as on GPUs):

- the device is ``cpu``: on GPUs each role keeps its own process (CUDA contexts, memory pools and
  engines such as vLLM's are per process);
- its strategy says ``shares_process_on_cpu`` (``StrategySpec``): hf_infer and fsdp2_train;
- each of its workers owns one device, and its workers sit on the same devices in the same rank
  order as the host's other roles (so ``RANK``, ``WORLD_SIZE``, ``ROLL_DEVICE_IDS`` and
  ``OMP_NUM_THREADS`` agree), with the same ``system_envs``;
- at most one role of a host ``uses_default_group`` (torch.distributed has one default group per
  process); a second such role keeps its own processes;
- ``riders`` (roles with no devices whose workers touch no process-wide state: rule rewards, which
  score in their own subprocesses) join the hosts round-robin by rank.

A group of fewer than two roles gets no hosts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from roll.configs.role import RoleConfig
from roll.configs.strategies import get_strategy_spec
from roll.distributed.scheduler.placement import PlacementPlan


@dataclass(frozen=True)
class HostPlan:
    """One host process: rank ``rank`` of each of ``roles`` on ``devices``, plus ``riders`` (role,
    rank) without devices, and the role that owns torch.distributed's default group (None: none
    of them uses one)."""

    index: int
    devices: tuple[int, ...]
    rank: int
    roles: tuple[str, ...]
    riders: tuple[tuple[str, int], ...] = ()
    group_owner: str | None = None

    @property
    def members(self) -> tuple[tuple[str, int], ...]:
        """Every (role, rank) the host holds: its device roles', then the riders'."""
        return tuple((role, self.rank) for role in self.roles) + self.riders


def plan_hosts(
    plan: PlacementPlan,
    roles: Mapping[str, RoleConfig],
    device: str,
    riders: Iterable[str] = (),
) -> list[HostPlan]:
    """The host processes of a run (see the module docstring); empty when none share a process."""
    if device != "cpu":
        return []
    groups: dict[tuple, list[str]] = {}
    for name, role_plan in plan.roles.items():
        if not _may_share(name, plan, roles):
            continue
        layout = tuple(w.devices for w in role_plan.workers)
        envs = tuple(sorted(roles[name].system_envs.items()))
        groups.setdefault((layout, envs), []).append(name)
    hosts: list[HostPlan] = []
    for (layout, _), names in groups.items():
        names = _one_group_user(names, roles)
        if len(names) < 2:
            continue
        owner = next((n for n in names if _uses_default_group(roles[n])), None)
        for rank, devices in enumerate(layout):
            hosts.append(HostPlan(len(hosts), devices, rank, tuple(names), group_owner=owner))
    if not hosts:
        return hosts
    return _add_riders(hosts, plan, riders)


def _may_share(name: str, plan: PlacementPlan, roles: Mapping[str, RoleConfig]) -> bool:
    role_plan = plan.roles[name]
    args = roles[name].strategy_args
    if role_plan.cpu_only or args is None or not get_strategy_spec(args.strategy_name).shares_process_on_cpu:
        return False
    return all(len(w.devices) == 1 for w in role_plan.workers)


def _uses_default_group(role: RoleConfig) -> bool:
    args = role.strategy_args
    return args is not None and get_strategy_spec(args.strategy_name).uses_default_group


def _one_group_user(names: list[str], roles: Mapping[str, RoleConfig]) -> list[str]:
    """``names`` less every role after the first that uses the default group."""
    users = [n for n in names if _uses_default_group(roles[n])]
    return [n for n in names if n not in users[1:]]


def _add_riders(hosts: list[HostPlan], plan: PlacementPlan, riders: Iterable[str]) -> list[HostPlan]:
    extra: dict[int, list[tuple[str, int]]] = {}
    for name in riders:
        for rank in range(plan.roles[name].world_size):
            extra.setdefault(rank % len(hosts), []).append((name, rank))
    return [dataclasses.replace(h, riders=tuple(extra.get(h.index, ()))) for h in hosts]
