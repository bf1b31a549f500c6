"""Each role against the strategy registry and the strategy's own options: the strategy exists and
fits the role, its ``strategy_config`` fits the role's devices and token budgets, a reward role's
function exists, and what an engine-backed strategy would refuse once started (its options against
the engine's argument dataclass, read from its source where it is installed, options that only an updated role can
use). Each failure is one ``ConfigError`` naming the key.

    check_role("actor_infer", config.actor_infer, config)
"""

from __future__ import annotations

import os
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RewardConfig, RoleConfig
from roll.configs.strategies import STRATEGIES, StrategySpec, check_engine_version, get_strategy_spec
from roll.configs.strategy_configs import (
    FSDP2Config,
    PackingOptions,
    SGLangConfig,
    VLLMConfig,
)
from roll.core.roles import TRAINER_ROLES
from roll.distributed.scheduler.placement import PlacementPlan
from roll.distributed.strategy.base import ValueModelStrategy
from roll.distributed.strategy.engine_options import (
    EngineOptions,
    sglang_engine_options,
    vllm_engine_options,
)
from roll.distributed.strategy.engine_startup import ENGINES, EngineKind, declared_options
from roll.distributed.strategy.generation import sampling_temperature
from roll.distributed.strategy.registry import implements
from roll.models.logprobs import transformers_detects_packing
from roll.pipeline.rewards.registry import get_reward_spec
from roll.utils.preload import is_installed


def check_role(name: str, role: RoleConfig, config: Any) -> None:
    """One role of an RLVR or SFT config (``config`` gives the run's lengths and sampling)."""
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
    if name in TRAINER_ROLES and spec.side != "train":
        raise ConfigError(
            f"{name}.strategy_args.strategy_name",
            f"{spec.name!r} cannot train; use fsdp2_train or megatron_train",
        )
    if name == "actor_infer" and spec.side != "infer":
        raise ConfigError(
            f"{name}.strategy_args.strategy_name",
            f"{spec.name!r} cannot generate; use hf_infer, megatron_infer, vllm or sglang",
        )
    _check_lora(name, role, spec)
    cfg_path = f"{name}.strategy_args.strategy_config"
    typed = role.strategy_args.strategy_config
    typed.validate(len(role.device_mapping), cfg_path)
    _check_token_budgets(typed, config, cfg_path)
    if name == "actor_infer" and getattr(typed, "context_parallel_size", 1) > 1:
        raise ConfigError(
            f"{cfg_path}.context_parallel_size",
            "generation has no context parallelism; use it on other roles",
        )
    if isinstance(typed, FSDP2Config) and typed.sequence_packing and not transformers_detects_packing():
        raise ConfigError(
            f"{cfg_path}.sequence_packing",
            "this transformers version cannot confine attention to packed sequences; set it false",
        )
    if role.model_args.is_value_model and not implements(spec, ValueModelStrategy):
        raise ConfigError(
            f"{name}.model_args.model_type",
            f"{spec.name} has no value head; run the critic with fsdp2_train (model_type 'value')",
        )
    if isinstance(typed, VLLMConfig):
        check_vllm_role(typed, name, role, config)
    if isinstance(typed, SGLangConfig):
        check_sglang_role(typed, name, role, config)
    if not role.model_args.model_name_or_path:
        raise ConfigError(
            f"{name}.model_args.model_name_or_path", "is required (a Hugging Face checkpoint directory)"
        )


def _check_lora(name: str, role: RoleConfig, spec: StrategySpec) -> None:
    """LoRA keys only on a trainer role whose strategy trains adapters (``StrategySpec.trains_lora``).
    Inference roles get merged weights from the trainer (actor_infer) or are the frozen base model
    (reference, model rewards), so a lora_* key there asks for nothing."""
    keys = role.model_args.lora_keys_set()
    if not keys:
        return
    key = f"{name}.model_args.{keys[0]}"
    if name not in TRAINER_ROLES:
        what = (
            "receives the trainer's merged weights (W + scale * B @ A)"
            if name == "actor_infer"
            else "is not trained"
        )
        raise ConfigError(
            key,
            f"{name} {what}; remove the lora_* keys here and set them on actor_train (fsdp2_train or "
            "megatron_train)",
        )
    if not spec.trains_lora:
        trains = [s.name for s in STRATEGIES.values() if s.trains_lora]
        raise ConfigError(
            key,
            f"{spec.name!r} cannot train LoRA adapters; use {' or '.join(trains)} for LoRA, or remove "
            "the lora_* keys to train every parameter",
        )
    if spec.name == "megatron_train":  # its targets are the fused megatron modules' HF names
        from roll.models.megatron.lora import megatron_targets

        megatron_targets(role.model_args.lora_target, f"{name}.model_args.lora_target")


def _check_token_budgets(typed: object, config: Any, path: str) -> None:
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
    spec = get_reward_spec(role.reward_fn, f"{name}.reward_fn")
    if spec.kind == "model" and (role.strategy_args is None or role.device_mapping is None):
        raise ConfigError(
            f"{name}.strategy_args",
            f"reward {spec.name!r} runs a model: set strategy_args, device_mapping and model_args",
        )


# ------------------------------------------------------------------------------- engines


def check_vllm_role(cfg: VLLMConfig, name: str, role: RoleConfig, config: RLVRConfig) -> None:
    """Options only a role that receives model updates can use, the temperature a vLLM reference
    scores at, and the engine options (against vllm.EngineArgs when vLLM imports here)."""
    path = f"{name}.strategy_args.strategy_config"
    if name != "actor_infer":
        if cfg.load_format == "dummy":
            raise ConfigError(
                f"{path}.load_format",
                f"'dummy' gives random weights and only actor_infer gets model updates; {name} needs real ones",
            )
        if cfg.sleep_level == 2:
            raise ConfigError(
                f"{path}.sleep_level",
                f"2 discards the weights and only actor_infer gets them back by model update; use 1 for {name}",
            )
    if name == "reference":
        temperature = sampling_temperature(config.actor_infer.generating_args.temperature)
        if temperature != 1.0:
            raise ConfigError(
                f"{name}.strategy_args.strategy_name",
                f"vllm scores with temperature 1 but actor_infer samples at {temperature}; use megatron_infer or hf_infer",
            )
    from roll.distributed.strategy.vllm_strategy import EXTENSION

    options = vllm_engine_options(cfg, role, name, config.seed, EXTENSION)
    _check_engine_options(options, ENGINES["vllm"])


def check_sglang_role(cfg: SGLangConfig, name: str, role: RoleConfig, config: RLVRConfig) -> None:
    """``load_format: dummy`` only on actor_infer; the engine options (against SGLang's
    ServerArgs when SGLang imports here)."""
    if name != "actor_infer" and cfg.load_format == "dummy":
        raise ConfigError(
            f"{name}.strategy_args.strategy_config.load_format",
            f"'dummy' gives random weights and only actor_infer gets model updates; {name} needs real ones",
        )
    options = sglang_engine_options(cfg, role, name, config.seed)
    _check_engine_options(options, ENGINES["sglang"])


def _check_engine_options(options: EngineOptions, kind: EngineKind) -> None:
    """Every option is one the installed engine accepts, read from the engine's source without
    importing it (``declared_options``). A driver without the engine (it lives on the GPU nodes)
    leaves this to the worker's own check."""
    try:
        accepted = declared_options(kind)
    except Exception:  # an unreadable or broken install: the worker that needs it reports it
        return
    if accepted is not None:
        options.check(accepted, kind.display, kind.package)


def engines_missing_here(config: Any) -> list[ConfigError]:
    """One ConfigError per role whose strategy needs a package (SGLang, vLLM, megatron-core) that
    is not installed on this machine, naming the pip extra."""
    missing = []
    for name, role in config.roles().items():
        if role.strategy_args is None:
            continue
        spec = get_strategy_spec(role.strategy_args.strategy_name)
        for module in spec.requires:
            if not is_installed(module):
                missing.append(
                    ConfigError(
                        f"{name}.strategy_args.strategy_name",
                        f"strategy {spec.name!r} needs the '{module}' package, which is not installed "
                        f"on this machine; install it with: pip install -e .[{spec.extra}]",
                    )
                )
                break
    return missing


def workers_start_here(plan: PlacementPlan) -> bool:
    """Whether the launch starts its workers on this machine: one node and no ``RAY_ADDRESS``
    (a private Ray, or one ``ray start`` ran here). Several nodes or another cluster's address:
    the engines live there, and a worker without its package reports it as it starts."""
    return plan.num_nodes == 1 and not os.environ.get("RAY_ADDRESS")


def check_engines_installed(config: Any, plan: PlacementPlan) -> None:
    """At launch (not ``--dry_run``, which plans on machines without the engines and prints these
    as notes): a strategy's package missing where the workers start is a ConfigError now, not a
    failed worker after Ray and the other roles have started."""
    missing = engines_missing_here(config)
    if missing and workers_start_here(plan):
        raise missing[0]
