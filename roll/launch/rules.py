"""Rules across keys of an RLVR run: devices that exist, batch sizes that divide, colocated engines
that can release their memory, the roles the algorithm needs, asynchronous generation's layout, the
tracker's package. Each failure is one ``ConfigError`` naming the key.

    plan = plan_placement(config)
    check_run_rules(config, plan)
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import strategy_options
from roll.core.roles import TRAINER_ROLES, Role
from roll.distributed.scheduler.placement import PlacementPlan
from roll.planner.devices import device_capacity
from roll.planner.report import plan_memory
from roll.planner.roles import GIB
from roll.utils.tracking import TRACKERS

# Largest share of a device a vLLM engine may claim next to a training role (see check_colocation).
COLOCATED_ENGINE_MEMORY = 0.9


def check_run_rules(config: RLVRConfig, plan: PlacementPlan) -> None:
    check_devices_exist(config, plan)
    check_batch_sizes(config, plan)
    check_colocation(config, plan)
    check_sglang_memory(config, plan)
    check_algorithm(config)
    check_generation_layout(config)
    check_async(config, plan)
    check_tracker(config)


def check_devices_exist(config: Any, plan: PlacementPlan) -> None:
    if config.num_nodes is None:
        return
    limit = config.num_nodes * config.num_gpus_per_node
    for name, rp in plan.roles.items():
        bad = [d for d in rp.devices if d >= limit]
        if bad:
            raise ConfigError(
                f"{name}.device_mapping",
                f"device {bad[0]} does not exist: num_nodes={config.num_nodes} x "
                f"num_gpus_per_node={config.num_gpus_per_node} gives devices 0-{limit - 1}",
            )


def check_batch_sizes(config: RLVRConfig, plan: PlacementPlan) -> None:
    samples = config.rollout_batch_size * config.num_return_sequences_in_group
    for name in TRAINER_ROLES:
        role = getattr(config, name)
        if role is None:
            continue
        args = role.training_args
        dp = plan.roles[name].parallel.dp
        mini = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp
        if samples % mini:
            raise ConfigError(
                f"{name}.training_args.gradient_accumulation_steps",
                f"rollout_batch_size x num_return_sequences_in_group = {samples} samples must divide into "
                f"mini-batches of per_device_train_batch_size x gradient_accumulation_steps x DP = "
                f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps} x {dp} = {mini}",
            )
    for name in ("reference", "critic"):
        rp = plan.roles.get(name)
        if rp is not None and samples % rp.parallel.dp:
            raise ConfigError(
                f"{name}.device_mapping",
                f"{samples} samples per step do not split across {name}'s {rp.parallel.dp} data-parallel ranks",
            )
    gen = config.actor_infer.generating_args
    if gen.num_return_sequences != config.num_return_sequences_in_group:
        raise ConfigError(
            "actor_infer.generating_args.num_return_sequences",
            f"is {gen.num_return_sequences} but num_return_sequences_in_group is "
            f"{config.num_return_sequences_in_group}; write ${{num_return_sequences_in_group}}",
        )
    if gen.max_new_tokens > config.response_length:
        raise ConfigError(
            "actor_infer.generating_args.max_new_tokens",
            f"{gen.max_new_tokens} exceeds response_length {config.response_length}; write ${{response_length}}",
        )


def check_colocation(config: RLVRConfig, plan: PlacementPlan) -> None:
    roles = config.roles()
    for owners, devices in plan.shared:
        trains = [o for o in owners if o in TRAINER_ROLES]
        if not trains:
            continue
        for name in owners:
            args = roles[name].strategy_args
            typed = strategy_options(roles[name])
            strategy = args.strategy_name if args is not None else ""
            if strategy == "vllm" and typed.sleep_level == 0:
                raise ConfigError(
                    f"{name}.strategy_args.strategy_config.sleep_level",
                    f"is 0 but {name} shares devices {list(devices)[:8]} with {trains[0]}; "
                    "set 1 so the engine frees its memory while training runs",
                )
            if strategy == "vllm" and typed.gpu_memory_utilization > COLOCATED_ENGINE_MEMORY:
                raise ConfigError(
                    f"{name}.strategy_args.strategy_config.gpu_memory_utilization",
                    f"is {typed.gpu_memory_utilization} but {name} shares devices with {trains[0]}, whose "
                    "CUDA context and parameters stay on the device while the engine is awake (model "
                    f"update, probe); use at most {COLOCATED_ENGINE_MEMORY}",
                )
            if strategy == "sglang" and not typed.enable_memory_saver:
                raise ConfigError(
                    f"{name}.strategy_args.strategy_config.enable_memory_saver",
                    f"is false but {name} shares devices with {trains[0]}; set true so the engine can release memory",
                )
            if (
                strategy == "sglang"
                and "actor_train" in owners
                and typed.model_update_transport == "distributed"
            ):
                raise ConfigError(
                    f"{name}.strategy_args.strategy_config.model_update_transport",
                    f"is 'distributed' but {name} shares devices {list(devices)[:8]} with actor_train, and "
                    "SGLang's NCCL group cannot hold two ranks on one device; use 'auto' (CUDA IPC on "
                    "shared devices, SGLang's group elsewhere) or 'tensor'",
                )


def check_sglang_memory(config: RLVRConfig, plan: PlacementPlan) -> None:
    """An SGLang engine on a trainer's devices keeps room for what the trainer leaves there while the
    engine is awake (its idle memory and CUDA context, as the memory planner predicts them).

    SGLang reserves ``mem_fraction_static`` of the device for weights + KV cache when it starts and
    takes the same again each time it resumes after the trainer ran. Checked when the device size
    is known (``gpu``, ``device_memory_gib`` or a visible GPU) and the model's shape can be read.
    """
    sharing = [
        name
        for owners, _ in plan.shared
        if any(o in TRAINER_ROLES for o in owners)
        for name in owners
        if _strategy(config, name) == "sglang"
    ]
    if not sharing or config.memory_check == "off":
        return
    capacity, source = device_capacity(config)
    if capacity is None:
        return
    for group in plan_memory(config, plan, capacity, source).groups:
        for engine in group.roles:
            others = [o for o in group.roles if o is not engine]
            trains = [o.role for o in others if o.role in TRAINER_ROLES]
            if engine.role not in sharing or not trains:
                continue
            resident = sum(o.idle + o.context for o in others)
            fits = (capacity - engine.context - resident) / capacity
            fraction = config.roles()[engine.role].strategy_args.strategy_config.mem_fraction_static
            if fraction <= fits:
                continue
            kept = ", ".join(f"{o.role} {(o.idle + o.context) / GIB:.1f}" for o in others)
            advice = (
                f"at most {int(fits * 100) / 100:.2f} fits"
                if fits > 0.01
                else f"none fits; offload {trains[0]}'s state or give {engine.role} devices of its own"
            )
            raise ConfigError(
                f"{engine.role}.strategy_args.strategy_config.mem_fraction_static",
                f"is {fraction} of the {capacity / GIB:.1f} GiB device ({source}), but the roles sharing "
                f"devices {list(group.devices)[:8]} keep {resident / GIB:.1f} GiB there while the engine is "
                f"awake ({kept} GiB predicted by the memory planner) and the engine's own CUDA context "
                f"needs {engine.context / GIB:.1f} GiB; {advice}",
            )


def _strategy(config: RLVRConfig, name: str) -> str:
    args = config.roles()[name].strategy_args
    return args.strategy_name if args is not None else ""


def check_algorithm(config: RLVRConfig) -> None:
    if config.adv_estimator == "gae" and config.critic is None:
        raise ConfigError("critic", "adv_estimator 'gae' needs a critic role")
    if config.critic is not None and config.adv_estimator != "gae":
        raise ConfigError(
            "critic", f"a critic is only used with adv_estimator 'gae', not {config.adv_estimator!r}"
        )
    if config.critic is not None and not config.critic.model_args.is_value_model:
        raise ConfigError("critic.model_args.model_type", "set 'value' so the critic gets a value head")
    wants_kl = config.use_kl_loss or (config.add_token_level_kl and config.init_kl_coef > 0)
    if wants_kl and config.reference is None:
        raise ConfigError("reference", "use_kl_loss / add_token_level_kl need a reference role")
    if config.off_policy_correction.mode != "none" and not config.actor_infer.generating_args.logprobs:
        raise ConfigError(
            "actor_infer.generating_args.logprobs",
            f"must be true: off_policy_correction.mode={config.off_policy_correction.mode!r} weighs the "
            "loss by the engine's log-probs",
        )
    if not config.rewards:
        raise ConfigError(
            "rewards", "at least one reward role is required, e.g. rewards: {math: {reward_fn: math_rule}}"
        )
    seen: dict[str, str] = {}
    for name, reward in config.rewards.items():
        for tag in reward.tag_included:
            if tag in seen:
                raise ConfigError(
                    f"rewards.{name}.tag_included", f"tag {tag!r} is already routed to rewards.{seen[tag]}"
                )
            seen[tag] = name


def check_generation_layout(config: RLVRConfig) -> None:
    """megatron_infer generates (roll.models.megatron.kv_generate) through one model chunk per
    pipeline stage: as actor_infer it cannot have virtual pipeline stages (scoring can)."""
    if _strategy(config, "actor_infer") != "megatron_infer":
        return
    cfg = config.actor_infer.strategy_args.strategy_config
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    if vpp > 1:
        key = (
            "pipeline_model_parallel_layout"
            if cfg.pipeline_model_parallel_layout
            else ("virtual_pipeline_model_parallel_size")
        )
        raise ConfigError(
            f"actor_infer.strategy_args.strategy_config.{key}",
            f"gives {vpp} virtual pipeline stages per rank, but megatron_infer generates with one model "
            "chunk per pipeline stage; use one stage per PP rank (a reference or reward role may keep them)",
        )


def check_tracker(config: Any) -> None:
    """The tracker's package is installed: found now, not after every worker has started."""
    package = TRACKERS.get(config.track_with)
    if package and package not in sys.modules and importlib.util.find_spec(package) is None:
        raise ConfigError(
            "track_with",
            f"{config.track_with!r} needs the {package} package (pip install {package}), "
            "or set track_with: none (metrics.jsonl is always written)",
        )


def check_async(config: RLVRConfig, plan: PlacementPlan) -> None:
    """Asynchronous generation needs actor_infer on devices of its own (it keeps generating while
    the other roles run) and trains on samples one weight version old: without the correction it
    runs, as in ROLL, with a warning."""
    if not config.async_generation_ratio:
        return
    for owners, devices in plan.shared:
        others = [name for name in owners if name != "actor_infer" and not Role.parse(name).is_reward]
        if "actor_infer" in owners and others:
            raise ConfigError(
                "async_generation_ratio",
                f"needs a disaggregated actor_infer, but it shares devices {list(devices)} with {others}; "
                "give actor_infer devices of its own or set async_generation_ratio: 0",
            )
    if config.off_policy_correction.mode == "none":
        print(
            "WARNING: async_generation_ratio: 1 trains on samples from the previous weight version with "
            "no off_policy_correction (as ROLL does); off_policy_correction.mode: tis or mis corrects "
            "it; the train/infer gap is logged as rollout/logprob_mismatch",
            file=sys.stderr,
        )
