"""Checks of what a loaded config points at, run before anything starts, for ``--dry_run`` and a
real launch alike: model and tokenizer directories, prompt files, tag routing to reward roles,
reward-function options, the checkpoint to resume from, and the rollout dump to write or replay.

    check_files(config)             # after the checks of the values (roll.launch.checks)

Each failure is one ``ConfigError`` naming the key path.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import DataArgs, RewardConfig, RoleConfig, strategy_options
from roll.configs.run_config import resume_requested
from roll.configs.strategies import STRATEGIES, get_strategy_spec
from roll.configs.strategy_configs import FSDP2Config, MegatronConfig, SGLangConfig, VLLMConfig
from roll.core.roles import Role, RoleKind
from roll.distributed.strategy.engine_options import check_engine_ep, check_engine_tp
from roll.distributed.strategy.sglang_vision import check_sglang_deepstack
from roll.models.expert_parallel import check_experts, config_experts
from roll.models.megatron.families import VISION_FAMILIES, get_family
from roll.models.megatron.model_fit import check_model_fits
from roll.models.model_dir import check_model_dir, config_json
from roll.models.ulysses import check_heads
from roll.models.vision import (
    UNRUN_VISION_MODEL_TYPES,
    VISION_MODEL_TYPES,
    check_vision_options,
    is_vision_model_dir,
)
from roll.pipeline.common.checkpoint import resolve_resume
from roll.pipeline.rewards.registry import check_reward_machine, get_reward_spec
from roll.pipeline.rewards.scoring import check_reward_kwargs
from roll.pipeline.rlvr.data.dataset import BadRow, read_rows, resolve_files
from roll.pipeline.rlvr.data.routing import build_tag_routes, reward_role_tags
from roll.pipeline.rlvr.data.sampler import check_domain_probs
from roll.pipeline.rlvr.rollout_dump import check_dump_dir

# Files one of which a directory needs for ``AutoTokenizer.from_pretrained`` to find a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Roles that load no tokenizer of their own (a critic only scores token ids).
NO_TOKENIZER_ROLES = ("critic",)


def check_files(config: RLVRConfig) -> None:
    """Raise one ConfigError for the first thing the config names that is missing or cannot work."""
    for name, role in config.roles().items():
        if not loads_model(role):
            continue
        key = f"{name}.model_args.model_name_or_path"
        check_model_dir(role.model_args.model_name_or_path, key)
        if name not in NO_TOKENIZER_ROLES:
            check_tokenizer_dir(role.model_args.model_name_or_path, key)
        check_vision_layout(name, role)
        check_megatron_layout(name, role)
        check_engine_role_layout(name, role)
        check_ulysses_layout(name, role)
        check_expert_layout(name, role)
    first: dict[str, str] = {}  # tag -> "file:line" of its first row
    train = prompt_tags(config.actor_train.data_args, "actor_train.data_args", first)
    tags = train.copy()
    if config.validation is not None and config.validation.data_args.file_name:
        tags.update(prompt_tags(config.validation.data_args, "validation.data_args", first))
    check_tag_routes(config, tags, first)
    probs = config.actor_train.data_args.domain_interleave_probs
    if probs:
        role_tags = reward_role_tags(config, train)
        check_domain_probs(probs, sorted(train), "actor_train.data_args.domain_interleave_probs", role_tags)
    check_reward_options(config)
    if resume_requested(config.resume_from_checkpoint):
        resolve_resume(config)
    check_vision_dump(config)
    check_video_strategies(config)
    check_dump_dir(config)  # rollout_dump: the replay's steps and values, or a dump dir not in use


def loads_model(role: RoleConfig) -> bool:
    """Every role but a rule reward (scored by a Python function; its model_args go unused)."""
    if not isinstance(role, RewardConfig):
        return True
    return get_reward_spec(role.reward_fn).kind == "model"


# Trainers that apply ``model_args.freeze_module_prefix`` (megatron_train: to the vision tower only).
FREEZES_MODULES = ("fsdp2_train", "megatron_train")


def check_vision_layout(name: str, role: RoleConfig) -> None:
    """``freeze_module_prefix`` only where fsdp2_train applies it, and a vision-language model
    (config.json with a ``vision_config``) only of a type roll has run, on strategies that pass it
    images (``StrategySpec.runs_vision``), with what its forward needs (fsdp2: no packing, no
    Ulysses; Megatron: packing and CP where the family's forward takes packed rows)."""
    strategy = role.strategy_args.strategy_name if role.strategy_args is not None else None
    path = role.model_args.model_name_or_path
    if is_vision_model_dir(path):
        check_vision_model(name, role, strategy)
    if role.model_args.freeze_module_prefix and strategy not in FREEZES_MODULES:
        raise ConfigError(
            f"{name}.model_args.freeze_module_prefix",
            f"is applied by {' and '.join(FREEZES_MODULES)} trainers only (strategy {strategy!r} here); remove it",
        )


def check_vision_model(name: str, role: RoleConfig, strategy: str | None) -> None:
    config = config_json(role.model_args.model_name_or_path)
    model_type = config.get("model_type")
    if model_type in UNRUN_VISION_MODEL_TYPES:
        raise ConfigError(
            f"{name}.model_args.model_name_or_path",
            f"vision-language model_type {model_type!r}: {UNRUN_VISION_MODEL_TYPES[model_type]}; roll runs "
            f"{', '.join(VISION_MODEL_TYPES)} (docs/vision_language.md)",
        )
    if model_type not in VISION_MODEL_TYPES:
        raise ConfigError(
            f"{name}.model_args.model_name_or_path",
            f"vision-language model_type {model_type!r}: roll's vision-language RLVR runs "
            f"{', '.join(VISION_MODEL_TYPES)} (Qwen2.5-VL, Qwen3-VL, Qwen3.5; docs/vision_language.md)",
        )
    if strategy is not None and not get_strategy_spec(strategy).runs_vision:
        runs = [s.name for s in STRATEGIES.values() if s.runs_vision]
        raise ConfigError(
            f"{name}.strategy_args.strategy_name",
            f"{strategy} does not run vision-language models in roll (no image inputs; ROLL builds them "
            f"with mcore_adapter); use one of {', '.join(runs)}",
        )
    check_vision_model_type(name, strategy, model_type)
    if strategy == "sglang":
        check_sglang_deepstack(config, f"{name}.model_args.model_name_or_path")
    if model_type == "qwen3_omni_moe" and strategy == "megatron_train":
        check_audio_tower_frozen(name, role.model_args.freeze_module_prefix)
    for key, value, why in (
        ("model_type", role.model_args.model_type, "a value head on a vision-language model (critic)"),
        ("lora_rank", role.model_args.lora_rank, "LoRA adapters on a vision-language model"),
    ):
        if value is not None:
            raise ConfigError(
                f"{name}.model_args.{key}",
                f"{value!r}: roll has not run {why}; remove it (docs/vision_language.md)",
            )
    cfg = strategy_options(role)
    if isinstance(cfg, FSDP2Config):
        check_vision_options(name, cfg.sequence_packing is True, cfg.ulysses_size)
    family = VISION_FAMILIES.get(model_type)
    if isinstance(cfg, MegatronConfig) and not (family is not None and family.packed_vision):
        check_vision_options(name, cfg.sequence_packing is True, 1)
        if cfg.context_parallel_size > 1:
            raise ConfigError(
                f"{name}.strategy_args.strategy_config.context_parallel_size",
                f"{cfg.context_parallel_size} does not run with {model_type} on Megatron (roll's context "
                "parallelism splits packed rows; its forward runs on padded rows); set it to 1",
            )


# Prefixes of freeze_module_prefix that name Qwen3-Omni's whole audio tower (ROLL's and roll's names).
AUDIO_TOWER_PREFIXES = ("audio_model", "audio_tower", "model.audio_tower", "thinker.audio_tower")


def check_audio_tower_frozen(name: str, prefixes: list[str] | None) -> None:
    """Training Qwen3-Omni's audio tower is not run in roll: a rank without audio rows would skip
    the tower's gradient reduction (the idle tower runs cover the vision tower only), so
    megatron_train needs it frozen, as ROLL's files do (``audio_model``)."""
    if not any(p in AUDIO_TOWER_PREFIXES for p in prefixes or []):
        raise ConfigError(
            f"{name}.model_args.freeze_module_prefix",
            f"{prefixes!r} leaves Qwen3-Omni's audio tower trainable, which roll has not run (ranks "
            "without audio rows would not join its gradient reduction); add audio_model, as ROLL's "
            "qwen3-omni files do",
        )


def check_vision_model_type(name: str, strategy: str | None, model_type: str) -> None:
    """A strategy that has run fewer vision-language model types than roll (``StrategySpec.
    vision_model_types``: SGLang's; fsdp2_train's and hf_infer's, all but Qwen3-Omni) refuses the
    others, naming the strategies of its side that run the type."""
    spec = get_strategy_spec(strategy) if strategy is not None else None
    allowed = spec.vision_model_types if spec is not None else None
    if allowed is not None and model_type not in allowed:
        runs = [
            s.name
            for s in STRATEGIES.values()
            if s.runs_vision
            and s.side == spec.side
            and (s.vision_model_types is None or model_type in s.vision_model_types)
        ]
        raise ConfigError(
            f"{name}.strategy_args.strategy_name",
            f"{strategy} runs vision-language model_type {', '.join(allowed)} in roll, not {model_type!r}; "
            f"use one of {', '.join(runs)}",
        )


def check_vision_dump(config: RLVRConfig) -> None:
    """``rollout_dump`` writes JSON and safetensors of text rollouts; a vision-language run's rows
    carry pixel inputs it does not write."""
    if config.rollout_dump.mode != "none" and is_vision_model_dir(
        config.actor_train.model_args.model_name_or_path
    ):
        raise ConfigError(
            "rollout_dump.mode",
            f"{config.rollout_dump.mode!r} does not write or read vision-language rollouts (their "
            "images); set it to none",
        )


def check_video_strategies(config: RLVRConfig) -> None:
    """Video-R1 rows (``data_args.row_layout: video_r1``, ROLL's video files) only where roll's
    forwards pass videos: on the Megatron strategies, model families with ``Family.videos``."""
    if config.actor_train.data_args.row_layout != "video_r1":
        return
    for name, role in config.roles().items():
        if not isinstance(strategy_options(role), MegatronConfig):
            continue
        model_type = config_json(role.model_args.model_name_or_path).get("model_type")
        family = VISION_FAMILIES.get(model_type)
        if family is None or not family.videos:
            raise ConfigError(
                f"{name}.strategy_args.strategy_name",
                f"{role.strategy_args.strategy_name} does not run video rows with {model_type} in roll "
                "(its forward takes images only; data_args.row_layout: video_r1 reads videos); use "
                "fsdp2_train (reference: hf_infer) with vllm rollouts",
            )


def check_megatron_layout(name: str, role: RoleConfig) -> None:
    """A megatron role's parallel layout against its model (heads per TP rank, layers per pipeline
    stage, experts per EP rank), read from config.json as the worker would build it."""
    cfg = strategy_options(role)
    if not isinstance(cfg, MegatronConfig):
        return
    hf_config = _readable_hf_config(role)
    if hf_config is None:
        return  # not a config transformers can read; the worker's model load names it
    try:
        check_model_fits(hf_config, cfg, f"{name}.strategy_args.strategy_config")
    except ConfigError as exc:
        if exc.path.startswith(name):
            raise
        raise ConfigError(f"{name}.{exc.path}", exc.message) from None
    family = get_family(hf_config)
    if _generates(name, role) and not family.generates:
        raise ConfigError(
            f"{name}.strategy_args.strategy_name",
            f"megatron_infer cannot generate with model_type {hf_config.model_type!r} ({family.no_generation})",
        )


def _generates(name: str, role: RoleConfig) -> bool:
    """The role samples text with its strategy: the rollouts' engine, or a generative judge."""
    return Role.parse(name).kind is RoleKind.INFER or (isinstance(role, RewardConfig) and loads_model(role))


def check_ulysses_layout(name: str, role: RoleConfig) -> None:
    """An fsdp2 role's ``ulysses_size`` against its model's attention and KV heads (config.json),
    the check the worker repeats when it loads the model."""
    cfg = strategy_options(role)
    if not isinstance(cfg, FSDP2Config) or cfg.ulysses_size == 1:
        return
    hf_config = _readable_hf_config(role)
    if hf_config is not None:
        check_heads(hf_config, cfg.ulysses_size, f"{name}.strategy_args.strategy_config.ulysses_size")


def check_expert_layout(name: str, role: RoleConfig) -> None:
    """An fsdp2 role's ``ep_size`` against its model's experts (config.json): a dense model or a
    count it does not divide is refused before launch, as the worker's model load would."""
    cfg = strategy_options(role)
    if not isinstance(cfg, FSDP2Config) or cfg.ep_size == 1:
        return
    hf_config = _readable_hf_config(role)
    if hf_config is not None:
        check_experts(config_experts(hf_config), cfg.ep_size, f"{name}.strategy_args.strategy_config.ep_size")


def _readable_hf_config(role: RoleConfig) -> Any:
    """The role's model config as transformers reads it; None for a config.json without a
    ``model_type`` (the worker's model load names that problem)."""
    path = Path(role.model_args.model_name_or_path)
    if "model_type" not in json.loads((path / "config.json").read_text() or "{}"):
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=role.model_args.trust_remote_code)


def check_engine_role_layout(name: str, role: RoleConfig) -> None:
    """A vLLM/SGLang role's tensor- and expert-parallel split against its model's heads and experts
    (config.json), before any engine starts (``engine_options.check_engine_tp`` / ``check_engine_ep``)."""
    cfg = strategy_options(role)
    if not isinstance(cfg, (VLLMConfig, SGLangConfig)):
        return
    path = f"{name}.strategy_args.strategy_config"
    model = role.model_args.model_name_or_path
    try:
        hf_config = json.loads((Path(model) / "config.json").read_text() or "{}")
    except ValueError as exc:
        raise ConfigError(
            f"{name}.model_args.model_name_or_path", f"{model}/config.json is not JSON ({exc})"
        ) from None
    check_engine_tp(hf_config, cfg.tensor_parallel_size, f"{path}.tensor_parallel_size", model)
    kwargs = cfg.engine_kwargs
    if isinstance(cfg, VLLMConfig) and kwargs.get("enable_expert_parallel"):
        dp = kwargs.get("data_parallel_size", 1)
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            raise ConfigError(
                f"{path}.engine_kwargs.data_parallel_size", f"must be an integer >= 1, got {dp!r}"
            )
        ep = cfg.tensor_parallel_size * dp
        what = f"enable_expert_parallel; tensor_parallel_size x data_parallel_size = {cfg.tensor_parallel_size} x {dp}"
        check_engine_ep(hf_config, ep, f"{path}.tensor_parallel_size", what, model)
    elif isinstance(cfg, SGLangConfig) and isinstance(kwargs.get("ep_size"), int):
        check_engine_ep(hf_config, kwargs["ep_size"], f"{path}.engine_kwargs.ep_size", "ep_size", model)


def check_tokenizer_dir(path: str, key: str) -> None:
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            key,
            f"{path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer there",
        )


def prompt_tags(data_args: DataArgs, prefix: str, first: dict[str, str] | None = None) -> Counter[str]:
    """Rows per tag over the good rows of every prompt file (bad rows are reported at load);
    ``first`` gets the ``file:line`` of each tag's first row (one already there is kept)."""
    tags: Counter[str] = Counter()
    bad: list[BadRow] = []
    for path in resolve_files(data_args, prefix):
        for row in read_rows(path, data_args, bad):
            tags[row.tag] += 1
            if first is not None:
                first.setdefault(row.tag, f"{path}:{row.line}")
    if not tags:
        raise ConfigError(
            f"{prefix}.file_name",
            f"no usable prompt rows in {data_args.file_name} (every row is empty or bad"
            + (f"; first: {bad[0]})" if bad else ")"),
        )
    return tags


def check_tag_routes(config: RLVRConfig, tags: Counter[str], first: dict[str, str] | None = None) -> None:
    """A tag of a reward role's ``tag_included`` that matches no row is a warning where the role
    still scores rows, or where ``domain_interleave_probs`` leaves the role out (alibaba/ROLL's files
    list tags their data lacks, and leave a judge's file out of the mix); a role that would score
    nothing otherwise is an error (a misspelt tag). Every tag of the data has a reward role (else the
    error names the ``file:line`` of the tag's first row, from ``first``)."""
    routes, catch_all = build_tag_routes(config)
    mixed = config.actor_train.data_args.domain_interleave_probs or {}
    for name, reward in config.rewards.items():
        unused = [tag for tag in reward.tag_included if tag not in tags]
        if not unused:
            continue
        scores = "the rows of its other tags" if len(unused) < len(reward.tag_included) else "no rows"
        if name == catch_all:
            scores = "the rows of its other tags and of every unlisted tag"
        elif scores == "no rows" and (not mixed or name in mixed or set(unused) & set(mixed)):
            raise ConfigError(
                f"rewards.{name}.tag_included[{reward.tag_included.index(unused[0])}]",
                f"tag {unused[0]!r} matches no row of the prompt files (their tags: {sorted(tags)}); "
                "fix the tag, or the rows' tag field (a row without one takes its file's stem)",
            )
        print(
            f"WARNING: rewards.{name}.tag_included: {unused} match no row of the prompt files "
            f"(their tags: {sorted(tags)}); the role scores {scores}, as in ROLL",
            file=sys.stderr,
        )
    if catch_all is None:
        for tag, count in sorted(tags.items()):
            if tag not in routes:
                where = f", the first at {first[tag]}" if first and tag in first else ""
                raise ConfigError(
                    "rewards",
                    f"no reward role claims tag {tag!r} ({count} prompt rows{where}); add it to a "
                    "role's tag_included, or leave one role's tag_included empty to score every other tag",
                )


def check_reward_options(config: RLVRConfig) -> None:
    """Every ``reward_kwargs`` key is an option of the reward function it is passed to, and what
    the options need of this machine is there (e.g. the code sandbox's bubblewrap)."""
    for name, reward in config.rewards.items():
        check_reward_kwargs(reward.reward_fn, reward.reward_kwargs, f"rewards.{name}.reward_kwargs")
        check_reward_machine(reward.reward_fn, reward.reward_kwargs, f"rewards.{name}.reward_kwargs")
