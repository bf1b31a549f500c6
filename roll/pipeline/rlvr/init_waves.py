"""Which roles initialize together at a run's start (the *waves*), what leaves the devices after
each wave, and starting a wave's ``initialize`` calls.

    waves = plan_waves(config, plan, clusters)            # [[engine roles], [the rest]] on GPUs
    results = [start_initialize(config, plan, clusters, name) for name in waves[0]]
    seconds = get_all(*results)                           # each rank's initialize seconds

The launcher's prestart starts the first wave while the driver still checks the config
(``prestart.py``); ``start.start_clusters`` waits for it and runs the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from roll.configs.pipeline_config import RLVRConfig
from roll.core.roles import Role
from roll.distributed.scheduler.placement import PlacementPlan

if TYPE_CHECKING:
    from roll.distributed.scheduler.cluster import AsyncResult, Cluster


def on_cpu_slots(config: RLVRConfig) -> bool:
    """Whether the run's device ids are CPU slots (``device: cpu``, or ``auto`` without CUDA)."""
    from roll.distributed.scheduler.resource_manager import resolve_device

    return resolve_device(config.device) == "cpu"


def init_waves(
    plan: PlacementPlan, names: Iterable[str], all_at_once: bool = False, fixed_memory: Iterable[str] = ()
) -> list[list[str]]:
    """Roles grouped into waves that initialize together. Only an engine that sizes its memory
    from what is free when it starts (``StrategySpec.sizes_from_free_memory``: vLLM, SGLang) must
    not initialize beside a role on its devices: engines come first, in the order of ``names``,
    each in the first wave after the last one holding a role that shares a device with it; every
    other role then joins the first wave after the last engine it shares a device with, so trainers,
    reference models and rewards initialize together (their memory is not sized from what is free,
    and an engine is offloaded before the next wave starts: ``offloads_after_waves``). CPU-only
    roles (rule rewards) share nothing. ``all_at_once``: one wave. ``fixed_memory``: engine roles
    told their memory in bytes (``fixed_engine_memory``), which join the others."""
    from roll.configs.strategies import STRATEGIES

    names = list(names)
    if all_at_once:
        return [names]
    fixed = set(fixed_memory)

    def sizes_from_free(name: str) -> bool:
        spec = STRATEGIES.get(plan.roles[name].strategy_name or "")
        return spec is not None and spec.sizes_from_free_memory and name not in fixed

    engines = [name for name in names if sizes_from_free(name)]
    waves: list[tuple[list[str], set[int], set[int]]] = []  # members, all devices, engines' devices
    for name in engines + [name for name in names if name not in engines]:
        role = plan.roles[name]
        devices = set() if role.cpu_only else set(role.devices)
        engine = name in engines
        after = max(
            (
                i
                for i, (_, used, by_engines) in enumerate(waves)
                if (used if engine else by_engines) & devices
            ),
            default=-1,
        )
        if after + 1 == len(waves):
            waves.append(([], set(), set()))
        members, used, by_engines = waves[after + 1]
        members.append(name)
        used.update(devices)
        if engine:
            by_engines.update(devices)
    return [members for members, _, _ in waves]


def fixed_engine_memory(config: RLVRConfig) -> set[str]:
    """The engine roles whose options say they size nothing from free memory (their
    ``sizes_from_free_memory()``: vLLM given ``kv_cache_memory_gb``), so they need not initialize
    alone."""
    fixed = set()
    for name, role in config.roles().items():
        args = role.strategy_args
        sizes = getattr(args.strategy_config, "sizes_from_free_memory", None) if args is not None else None
        if sizes is not None and not sizes():
            fixed.add(name)
    return fixed


def offloads_after_waves(plan: PlacementPlan, waves: list[list[str]], colocated: set[str]) -> list[list[str]]:
    """Per wave of ``init_waves``: the colocated roles to offload once it has initialized. A role
    leaves its devices before a later wave initializes a role on them, so the start-up never holds
    more of a device than one stage does (an engine's whole memory beside a trainer's weights and
    optimizer states was the start-up's peak: 91 GiB on one H200 for the 1.5B one-GPU config,
    where its stages peak at 76 GiB); the rest once the last wave is done."""
    offloads: list[list[str]] = [[] for _ in waves]
    for i, wave in enumerate(waves):
        later = {
            d for w in waves[i + 1 :] for n in w if not plan.roles[n].cpu_only for d in plan.roles[n].devices
        }
        for name in wave:
            if name in colocated:
                offloads[i if later & set(plan.roles[name].devices) else len(waves) - 1].append(name)
    return [sorted(names) for names in offloads]


def plan_waves(config: RLVRConfig, plan: PlacementPlan, names: Iterable[str]) -> list[list[str]]:
    """``init_waves`` of the run's roles: one wave on CPU slots, engines first and alone on GPUs."""
    return init_waves(plan, names, all_at_once=on_cpu_slots(config), fixed_memory=fixed_engine_memory(config))


def start_initialize(
    config: RLVRConfig, plan: PlacementPlan, clusters: Mapping[str, Cluster], name: str
) -> AsyncResult:
    """Every rank's ``initialize`` of role ``name``, started (trainers get their optimizer steps)."""
    from roll.pipeline.workers.model_worker import ModelWorker
    from roll.pipeline.workers.reward_worker import RewardWorker
    from roll.utils.lr_schedule import total_optimizer_steps

    role = Role.parse(name)
    if role.is_reward:
        return clusters[name].async_call(RewardWorker.initialize)
    steps = None
    if role.is_trainer:  # the LR schedule length, computed here once per role
        dp = plan.roles[name].parallel.dp
        steps = total_optimizer_steps(config, getattr(config, name).training_args, dp)
    return clusters[name].async_call(ModelWorker.initialize, steps)
