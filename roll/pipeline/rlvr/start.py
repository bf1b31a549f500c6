"""Starting an RLVR run, top to bottom: ``build_run`` is the one entry, ``shutdown`` its inverse.

    launch/rlvr.py    prestart(config)             Ray, devices, host processes and workers, on a thread
    pipeline.py       run = build_run(config, timer)
      build_run         plan, tokenizer, prompt data (data/routing.py), then:
      start_clusters    take_prestart (or start Ray and the workers here), initialize in waves
      model update      the trainer -> engine group, set up once
    pipeline.py       the step loop over ``run``; finally shutdown(run)

Worker processes of all roles start together (``prestart.start_workers``; by the launcher, while it
checks the config): each one imports torch and its engine, which is most of a CPU run's start-up, and
waiting for one role's ranks before asking for the next role's left cores idle. ``initialize`` (model load, engine start) then runs at once for every role except a
GPU engine that shares a device: an engine sizes its memory from what is free when it starts
(vLLM profiles ``gpu_memory_utilization``), so it initializes first and alone on its devices, and
the roles sharing them initialize together after it (``init_waves``), unless its KV cache is given
in bytes (vLLM ``kv_cache_memory_gb``). A GPU engine or megatron worker starts
importing its engine or megatron-core when it is constructed (``StrategySpec.preload``), beside the
other roles' start. CPU slots size nothing from free memory, so there every role initializes at once.
A colocated role is offloaded once its wave has initialized if a later wave uses its devices, and
after the last wave otherwise (``offloads_after_waves``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roll.configs.pipeline_config import RLVRConfig
from roll.core.roles import Role
from roll.distributed.scheduler.placement import PlacementPlan, plan_placement
from roll.pipeline.common.run_log import setup_logging
from roll.pipeline.common.timing import StageTimer
from roll.pipeline.rlvr.data.routing import build_tag_routes, load_data
from roll.pipeline.rlvr.run import RLVRRun
from roll.utils.start_marks import process_started_at, relative_marks

if TYPE_CHECKING:
    from roll.distributed.scheduler.cluster import AsyncResult

logger = logging.getLogger("roll")


def build_run(config: RLVRConfig, timer: StageTimer | None = None) -> RLVRRun:
    """Plan, data, workers (``start_clusters``) and the model-update group; ``timer`` records the
    start-up phases (``startup/*`` metrics). A failure on the way stops what had started."""
    from roll.models.tokenizer import load_tokenizer
    from roll.models.vision import VisionProcessor, is_vision_model_dir

    timer = timer or StageTimer()
    run_dir = Path(config.output_dir)
    setup_logging(run_dir)
    plan = plan_placement(config)
    with timer("data"):
        model_args = config.actor_train.model_args
        processor = None
        if is_vision_model_dir(model_args.model_name_or_path):  # docs/vision_language.md
            processor = VisionProcessor.load(model_args.model_name_or_path, model_args.trust_remote_code)
        tokenizer = processor.tokenizer if processor else load_tokenizer(model_args.model_name_or_path)
        sampler, val = load_data(config, tokenizer, processor)
    routes, default = build_tag_routes(config)
    run = RLVRRun(config, plan, run_dir, tokenizer, sampler, tag_routes=routes, default_reward=default)
    run.processor = processor
    run.val_prompts = val
    if config.validation is not None:
        run.val_generating_args = config.validation.generating_args
        run.val_batch_size = config.validation.val_batch_size or config.rollout_batch_size
    run.colocated = offloaded_roles(config, plan)
    run.refill_on_wake = refills_on_wake(config, run.colocated)
    try:
        start_clusters(run, timer)
        with timer("model_update_setup"):
            run.model_update = _build_model_update(run)
    except BaseException:
        shutdown(run, graceful=False)  # the caller has no run to shut down yet
        raise
    return run


def _build_model_update(run: RLVRRun):
    from roll.distributed.model_update.group import ModelUpdateGroup

    group = ModelUpdateGroup(run.model("actor_train"), run.model("actor_infer"), run.config)
    group.setup()
    return group


def shutdown(run: RLVRRun | None, graceful: bool = True) -> None:
    """Stop every role's workers (``graceful``: let them leave their process groups first) and give
    the devices back."""
    if run is None:
        return
    for cluster in run.clusters.values():
        try:
            cluster.shutdown(graceful=graceful)
        except Exception as exc:  # noqa: BLE001 - best effort while tearing down
            logger.warning("shutting down %s: %s", getattr(cluster, "role", "?"), exc)
    for host in run.hosts:  # those whose members never started (another role failed first)
        host.kill()
    if run.resources is not None:  # after a failure the driver is leaving: do not wait long
        run.resources.destroy(timeout_s=30.0 if graceful else 1.0)


def on_cpu_slots(config: RLVRConfig) -> bool:
    """Whether the run's device ids are CPU slots (``device: cpu``, or ``auto`` without CUDA)."""
    from roll.distributed.scheduler.ray_start import resolve_device

    return resolve_device(config.device) == "cpu"


def offloaded_roles(config: RLVRConfig, plan: PlacementPlan) -> set[str]:
    """The model roles that time-share devices with another role and so are offloaded between
    their stages (``stages.on_devices``).

    On CPU slots a role is left out unless its strategy offloads there
    (``StrategySpec.offloads_on_cpu``): the others would only free device memory, which a CPU slot
    does not have, and each skipped stage saves two Ray round trips to every rank."""
    from roll.configs.strategies import get_strategy_spec

    cpu = on_cpu_slots(config)
    roles = config.roles()
    shared = {name for owners, _ in plan.shared for name in owners if not Role.parse(name).is_reward}

    def offloads(name: str) -> bool:
        args = roles[name].strategy_args
        return not cpu or (args is not None and get_strategy_spec(args.strategy_name).offloads_on_cpu)

    return {name for name in shared if offloads(name)}


def refills_on_wake(config: RLVRConfig, colocated: set[str]) -> bool:
    """Whether actor_infer loses its weights each time it is offloaded between the stages of a
    colocated layout (its options' ``drops_weights_on_offload``: vLLM ``sleep_level: 2``, SGLang
    with the memory saver), so each wake must refill them."""
    if "actor_infer" not in colocated:
        return False
    args = config.actor_infer.strategy_args
    drops = getattr(args.strategy_config, "drops_weights_on_offload", None) if args is not None else None
    return bool(drops is not None and drops())


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


def start_clusters(run: RLVRRun, timer: StageTimer) -> None:
    """Reserve the devices, start every role's workers (see the module docstring) and initialize
    them; colocated roles end offloaded. Clusters that started are in ``run.clusters`` even when
    another role failed, so ``run.shutdown`` stops them."""
    from roll.distributed.scheduler.cluster import get_all
    from roll.distributed.scheduler.resource_manager import ResourceManager
    from roll.pipeline.rlvr.prestart import start_hosts, start_workers, take_prestart
    from roll.pipeline.workers.model_worker import ModelWorker

    config = run.config
    with timer("ray"):  # only the wait for it when the launcher started it early (``prestart``)
        early = take_prestart(config)
        if early is not None:
            run.resources, run.hosts = early.resources, early.hosts
        else:
            run.resources = ResourceManager(run.plan, config.device)
            hosted, run.hosts = start_hosts(config, run.plan, run.resources)
    with timer("workers"):  # likewise: what is left of the workers' start after the checks
        if early is not None:
            try:
                early.wait_workers()
            finally:
                run.clusters.update(early.clusters)  # those that started, for the shutdown
        else:
            start_workers(config, run.plan, run.resources, hosted, run.clusters)
        check_worker_nodes(run)
    record_driver_marks(timer, getattr(run.resources, "marks", {}))
    with timer("initialize"):
        waves = init_waves(
            run.plan, run.clusters, all_at_once=on_cpu_slots(config), fixed_memory=fixed_engine_memory(config)
        )
        # Colocated roles start offloaded; each stage brings its role on (see stages.on_devices).
        for wave, offload in zip(waves, offloads_after_waves(run.plan, waves, run.colocated)):
            seconds = get_all(*(_async_initialize(run, name) for name in wave))
            for name, per_rank in zip(wave, seconds):
                run.clusters[name].refresh_dp_layout()
                record_initialize(timer, name, per_rank)
            get_all(*(run.model(name).async_call(ModelWorker.offload_states) for name in offload))


def check_worker_nodes(run: RLVRRun) -> None:
    """Every device-holding worker runs on the Ray node its plan's node was reserved on (each rank
    reports its own node id; ``ResourceManager.check_worker_nodes``), and run.log says which ranks
    run where (on the console too when the run spans nodes). When it does, a CPU-only role's ranks
    (rule rewards: Ray places them) learn their nodes too, so a dead node is named whichever role's
    call meets the death first."""
    from roll.distributed.executor.worker import Worker
    from roll.distributed.scheduler.cluster import get_all

    multinode = run.plan.num_nodes > 1
    asked = [name for name in run.clusters if multinode or not run.plan.roles[name].cpu_only]
    placed = {name: run.plan.roles[name] for name in asked if not run.plan.roles[name].cpu_only}
    answers = get_all(*(run.clusters[name].async_call(Worker.ping) for name in asked))
    for name, pings in zip(asked, answers):  # one round for every role asked
        if name in placed:
            run.resources.check_worker_nodes(placed[name], [p["node_id"] for p in pings])
        else:
            run.clusters[name].nodes = {
                rank: run.resources.name_node(p["node_id"]) for rank, p in enumerate(pings)
            }
    level = logging.INFO if multinode else logging.DEBUG
    for line in run.resources.describe(placed).splitlines():
        logger.log(level, "placement: %s", line)


def record_driver_marks(timer: StageTimer, marks: dict[str, float]) -> None:
    """When Ray was up, the devices reserved and the device slots probed (``ResourceManager.marks``),
    in seconds after the driver's start, as ``timeline.driver.<mark>`` (``startup/timeline.driver.ray_s``
    ...): with the workers' marks, where the start-up went before the workers' processes started."""
    since = process_started_at()
    timer.times.update({f"time/timeline.driver.{name}": at - since for name, at in marks.items()})


def record_initialize(timer: StageTimer, role: str, per_rank: list[dict[str, Any] | None] | None) -> None:
    """The slowest rank's ``initialize`` seconds of ``role`` as start-up phase
    ``initialize.<role>`` (``startup/initialize.<role>_s``): which role the start-up waited on.

    The marks of the rank that finished last (``roll.utils.start_marks``) go to run.log as seconds
    after the driver's start; when that rank finished after every role recorded before, they become
    the ``timeline.*`` phases (``startup/timeline.at.process_s``, ``at.ready``, ``at.initialize``,
    ``at.initialized``, then spans such as ``imports_wait`` and the strategy's own, e.g.
    ``megatron.build``): where the role the start-up waited for spent its time."""
    reports = [r for r in per_rank or [] if isinstance(r, dict) and "seconds" in r]
    if not reports:
        return
    timer.times[f"time/initialize.{role}"] = max(r["seconds"] for r in reports)
    last = max(reports, key=lambda r: r.get("at", {}).get("initialized", 0.0))
    marks = relative_marks(last, process_started_at())
    logger.info(
        "start-up of %s (its last rank, seconds after the driver started): %s",
        role,
        ", ".join(f"{name} {value:.1f}" for name, value in marks.items()),
    )
    if marks.get("at.initialized", 0.0) >= timer.times.get("time/timeline.at.initialized", float("-inf")):
        for key in [k for k in timer.times if k.startswith("time/timeline.") and ".driver." not in k]:
            del timer.times[key]
        timer.times.update({f"time/timeline.{name}": value for name, value in marks.items()})


def _async_initialize(run: RLVRRun, name: str) -> AsyncResult:
    """Every rank's ``initialize`` of role ``name``, started (trainers get their optimizer steps)."""
    from roll.pipeline.workers.model_worker import ModelWorker
    from roll.pipeline.workers.reward_worker import RewardWorker
    from roll.utils.lr_schedule import total_optimizer_steps

    role = Role.parse(name)
    if role.is_reward:
        return run.clusters[name].async_call(RewardWorker.initialize)
    steps = None
    if role.is_trainer:  # the LR schedule length, computed here once per role
        dp = run.plan.roles[name].parallel.dp
        steps = total_optimizer_steps(run.config, getattr(run.config, name).training_args, dp)
    return run.model(name).async_call(ModelWorker.initialize, steps)
