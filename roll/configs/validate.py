"""Cross-field checks that run before anything starts. Each failure is one ConfigError."""

from __future__ import annotations

import importlib.util
import sys

from roll.configs.errors import ConfigError
from roll.configs.loader import build_dataclass
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RewardConfig, RoleConfig
from roll.configs.strategy_configs import PackingOptions

TRAIN_ROLES = ("actor_train", "critic")
# Largest share of a device a vLLM engine may claim next to a training role (see _check_colocation).
COLOCATED_ENGINE_MEMORY = 0.9


def validate_config(config: RLVRConfig) -> None:
    """Check roles, strategies, placement, batch sizes, colocation and the algorithm's needs."""
    from roll.distributed.scheduler.placement import plan_placement

    for name, role in config.roles().items():
        _check_role(name, role, config)
    plan = plan_placement(config)
    _check_devices_exist(config, plan)
    _check_batch_sizes(config, plan)
    _check_colocation(config, plan)
    _check_algorithm(config)
    _check_async(config, plan)
    _check_tracker(config)


def _check_role(name: str, role: RoleConfig, config: RLVRConfig) -> None:
    from roll.distributed.strategy.registry import check_engine_version, get_strategy_spec

    is_reward = isinstance(role, RewardConfig)
    if is_reward:
        _check_reward(name, role)
    if role.strategy_args is None:
        if is_reward and role.device_mapping is None:
            return
        raise ConfigError(
            f"{name}.strategy_args", "is required: set strategy_name (e.g. hf_infer) and strategy_config"
        )
    if role.device_mapping is None:
        raise ConfigError(f"{name}.device_mapping", "is required for a role with a strategy, e.g. '0-7'")
    spec = get_strategy_spec(role.strategy_args.strategy_name, f"{name}.strategy_args.strategy_name")
    check_engine_version(spec, f"{name}.strategy_args.strategy_name")
    if name in TRAIN_ROLES and spec.side != "train":
        raise ConfigError(
            f"{name}.strategy_args.strategy_name",
            f"{spec.name!r} cannot train; use fsdp2_train or megatron_train",
        )
    if name == "actor_infer" and spec.side != "infer":
        raise ConfigError(
            f"{name}.strategy_args.strategy_name",
            f"{spec.name!r} cannot generate; use hf_infer, megatron_infer, vllm or sglang",
        )
    cfg_path = f"{name}.strategy_args.strategy_config"
    typed = build_dataclass(spec.config_cls, role.strategy_args.strategy_config or {}, cfg_path)
    typed.validate(len(role.device_mapping), cfg_path)
    _check_token_budgets(typed, config, cfg_path)
    if name == "actor_infer" and getattr(typed, "context_parallel_size", 1) > 1:
        raise ConfigError(
            f"{cfg_path}.context_parallel_size",
            "generation has no context parallelism; use it on other roles",
        )
    role.strategy_args.config = typed
    if not role.model_args.model_name_or_path:
        raise ConfigError(
            f"{name}.model_args.model_name_or_path", "is required (a Hugging Face checkpoint directory)"
        )


def _check_token_budgets(typed: object, config: RLVRConfig, path: str) -> None:
    """A token budget must hold the longest sequence a step can have: prompt + response in an RLVR
    run, ``data.max_length`` in an SFT run."""
    if not isinstance(typed, PackingOptions):
        return
    if hasattr(config, "prompt_length"):
        longest, what = config.prompt_length + config.response_length, "prompt_length + response_length"
    else:
        longest, what = config.data.max_length, "data.max_length"
    for key in ("max_tokens_per_microbatch", "infer_max_tokens_per_microbatch"):
        budget = getattr(typed, key)
        if budget is not None and budget < longest:
            raise ConfigError(
                f"{path}.{key}", f"{budget} tokens cannot hold one sequence of {what} = {longest}"
            )


def _check_reward(name: str, role: RewardConfig) -> None:
    from roll.pipeline.rlvr.rewards.registry import get_reward_spec

    spec = get_reward_spec(role.reward_fn, f"{name}.reward_fn")
    if spec.kind == "model" and (role.strategy_args is None or role.device_mapping is None):
        raise ConfigError(
            f"{name}.strategy_args",
            f"reward {spec.name!r} runs a model: set strategy_args, device_mapping and model_args",
        )


def _check_devices_exist(config: RLVRConfig, plan) -> None:
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


def _check_batch_sizes(config: RLVRConfig, plan) -> None:
    samples = config.rollout_batch_size * config.num_return_sequences_in_group
    for name in TRAIN_ROLES:
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


def _check_colocation(config: RLVRConfig, plan) -> None:
    roles = config.roles()
    for owners, devices in plan.shared:
        trains = [o for o in owners if o in TRAIN_ROLES]
        if not trains:
            continue
        for name in owners:
            args = roles[name].strategy_args
            typed = args.config if args is not None else None
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
            if strategy == "vllm" and typed.sleep_level == 2 and name == "actor_infer":
                raise ConfigError(
                    f"{name}.strategy_args.strategy_config.sleep_level",
                    f"is 2 but {name} shares devices with {trains[0]}: level 2 drops the weights at every "
                    "offload, and the pipeline offloads the engine after each model update (before it "
                    "generates again); set 1 (weights wait in CPU memory)",
                )
            if strategy == "sglang" and not typed.enable_memory_saver:
                raise ConfigError(
                    f"{name}.strategy_args.strategy_config.enable_memory_saver",
                    f"is false but {name} shares devices with {trains[0]}; set true so the engine can release memory",
                )


def _check_algorithm(config: RLVRConfig) -> None:
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


# track_with -> the package it needs.
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def _check_tracker(config: RLVRConfig) -> None:
    """The tracker's package is installed: found now, not after every worker has started."""
    package = TRACKER_PACKAGES.get(config.track_with)
    if package and package not in sys.modules and importlib.util.find_spec(package) is None:
        raise ConfigError(
            "track_with",
            f"{config.track_with!r} needs the {package} package (pip install {package}), "
            "or set track_with: none (metrics.jsonl is always written)",
        )


def _check_async(config: RLVRConfig, plan) -> None:
    """Asynchronous generation needs actor_infer on devices of its own (it keeps generating while
    the other roles run) and trains on samples one weight version old, so it needs the correction."""
    if not config.async_generation_ratio:
        return
    for owners, devices in plan.shared:
        others = [name for name in owners if name != "actor_infer" and not name.startswith("rewards.")]
        if "actor_infer" in owners and others:
            raise ConfigError(
                "async_generation_ratio",
                f"needs a disaggregated actor_infer, but it shares devices {list(devices)} with {others}; "
                "give actor_infer devices of its own or set async_generation_ratio: 0",
            )
    if config.off_policy_correction.mode == "none":
        raise ConfigError(
            "off_policy_correction.mode",
            "async_generation_ratio: 1 trains on samples from the previous weight version; set tis or mis",
        )
