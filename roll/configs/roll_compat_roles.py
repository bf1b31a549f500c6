"""alibaba/ROLL's role-level keys onto roll's: devices per worker, each strategy's options (FSDP2,
Megatron, vLLM/SGLang engine arguments), sequence packing and dynamic batching. Part of
``roll.configs.roll_compat``'s translation, which calls ``map_role`` for every role and
``map_strategy`` for reward roles:

>>> problems, notes = Problems(), []
>>> role = {"num_gpus_per_worker": 2, "strategy_args": {"strategy_name": "vllm", "strategy_config": {}}}
>>> map_role(role, "actor_infer", problems, notes)
>>> role["strategy_args"]["strategy_config"]["tensor_parallel_size"]
2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from roll.configs.device_mapping import parse_device_mapping
from roll.configs.strategy_configs import STRATEGY_CONFIGS

# ActorPGWorker is ROLL's worker for pg_variant; roll's one actor worker computes every variant.
ACTOR_WORKERS = ("ActorWorker", "ActorPGWorker")


def class_name(dotted: Any) -> str:
    """``x.y.MathRuleRewardWorker`` -> ``MathRuleRewardWorker``."""
    return str(dotted).rsplit(".", 1)[-1]


class Problems:
    """Collects the refused keys of one file so they are reported together; keys with the same
    advice share it (``lora_target=..., lora_rank=64 (ROLL trains LoRA adapters ...)``)."""

    def __init__(self) -> None:
        self.by_advice: dict[str, list[str]] = {}

    def add(self, path: str, advice: str) -> None:
        self.by_advice.setdefault(advice, []).append(path)

    @property
    def items(self) -> list[str]:
        return [f"{', '.join(paths)} ({advice})" for advice, paths in self.by_advice.items()]


def drop_offload_nccl(node: dict[str, Any], path: str, notes: list[str]) -> None:
    """ROLL's ``offload_nccl`` (top level or per role) frees NCCL buffers while a role sleeps."""
    if node.pop("offload_nccl", None):
        notes.append(
            f"WARNING: {path}: true dropped; ROLL frees the NCCL buffers while a role sleeps, roll keeps "
            "its communicators on the device (plan a little more device memory)"
        )


def map_role(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """Map the ROLL keys of one model role (``path``: actor_train, ...) in place; refusals go to
    ``problems``, what was mapped or dropped to ``notes``."""
    drop_offload_nccl(role, f"{path}.offload_nccl", notes)
    if "worker_cls" in role:
        cls = class_name(role.pop("worker_cls"))
        if cls not in ACTOR_WORKERS:
            problems.add(f"{path}.worker_cls={cls}", "remove it; roll's roles use one worker class each")
    for key, mapper in ROLE_MAPPERS.items():
        if key in role:
            mapper(role, f"{path}.{key}", problems, notes)


def _map_num_gpus_per_worker(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL's devices per inference worker is roll's engine ``tensor_parallel_size``."""
    value = role.pop("num_gpus_per_worker")
    args = role.get("strategy_args") or {}
    if args.get("strategy_name") not in ("vllm", "sglang"):
        if value not in (None, 1):
            problems.add(f"{path}={value!r}", "only vllm/sglang workers span devices (tensor_parallel_size)")
        return
    config = args.setdefault("strategy_config", {}) or {}
    args["strategy_config"] = config
    tp = config.setdefault("tensor_parallel_size", value)
    if tp != value:
        problems.add(f"{path}={value!r}", f"must equal strategy_config.tensor_parallel_size ({tp})")
    else:
        notes.append(f"{path}: {value} -> strategy_config.tensor_parallel_size: {value}")


# ROLL's reduce_dtype spellings -> roll's FSDP2Config.reduce_dtype.
REDUCE_DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}


# ROLL's FSDP2 expert-parallel layout: refused (roll's fsdp2 shards whole layers over all devices).
_EP = "use megatron_train with expert_model_parallel_size"
FSDP2_LAYOUT_KEYS = {
    "ep_size": f"ROLL shards MoE experts over ep_size devices in fsdp2; roll's fsdp2 has no expert parallelism: {_EP}",
    "efsdp_size": f"ROLL's FSDP group size of the expert-parallel layout; roll's fsdp2 has none: {_EP}",
}
# ROLL's FSDP2 memory and kernel options roll does not have: the same model and loss, other memory use.
FSDP2_DROPPED = {
    "apply_tiled_mlp": "ROLL runs the MLP in tiles to cut activation memory; roll runs it whole",
    "tiled_num_shards": "the tile count of apply_tiled_mlp; roll runs the MLP whole",
    "apply_expert_patch": "ROLL's MoE expert patch for FSDP2 (Ascend examples); roll uses transformers' MoE blocks",
    "moe_use_grouped_mm": "roll uses transformers' MoE blocks as they are",
    "wrap_policy": "roll shards each decoder layer and the whole model (embeddings and lm_head with the root)",
}


def _map_fsdp2(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL's FSDP2 keys onto roll's FSDP2Config: full sharding over the role's devices, mixed
    precision as the model dtype for parameters, gradient reduction in fp32 or bf16, CPU offload,
    ``use_remove_padding`` as sequence packing."""
    config, at = role["strategy_args"]["strategy_config"], f"{path}.strategy_config"
    size = config.pop("fsdp_size", None)
    if size is not None and size not in (_num_devices(role, path), -1):
        problems.add(
            f"{at}.fsdp_size={size!r}", "remove it; roll shards over all the role's devices (no HSDP)"
        )
    if "offload_policy" in config:
        config.setdefault("cpu_offload", bool(config.pop("offload_policy")))
    param = config.pop("param_dtype", None)
    dtype = (role.get("model_args") or {}).get("dtype", "bf16")
    if param is not None and param not in (dtype, "bfloat16" if dtype == "bf16" else dtype):
        problems.add(
            f"{at}.param_dtype={param!r}", f"remove it; parameters compute in model_args.dtype ({dtype})"
        )
    reduce = config.get("reduce_dtype")
    if reduce is not None and reduce not in REDUCE_DTYPES:
        problems.add(
            f"{at}.reduce_dtype={reduce!r}",
            f"gradients reduce in one of {', '.join(REDUCE_DTYPES)} (FSDP2 MixedPrecisionPolicy.reduce_dtype)",
        )
    elif reduce is not None:
        config["reduce_dtype"] = REDUCE_DTYPES[reduce]
    if param is not None or reduce is not None:
        config.setdefault("mixed_precision", True)
        notes.append(f"{at}: param_dtype/reduce_dtype -> mixed_precision: true")
    if "use_remove_padding" in config:
        _remove_padding_to_packing(config.pop("use_remove_padding"), config, at, problems, notes)
    for key, what in FSDP2_LAYOUT_KEYS.items():
        if config.get(key) not in (None, 1, -1):
            problems.add(f"{at}.{key}={config[key]!r}", what)
        config.pop(key, None)
    for key, what in FSDP2_DROPPED.items():
        if key in config:
            notes.append(f"WARNING: {at}.{key}: {config.pop(key)!r} dropped; {what}")


def _remove_padding_to_packing(
    value: Any, config: dict[str, Any], at: str, problems: Problems, notes: list[str]
) -> None:
    """ROLL's ``use_remove_padding``: rows packed without padding, roll's ``sequence_packing``."""
    if config.setdefault("sequence_packing", bool(value)) != bool(value):
        problems.add(f"{at}.use_remove_padding={value!r}", "conflicts with strategy_config.sequence_packing")
    else:
        notes.append(f"{at}.use_remove_padding: {value!r} -> strategy_config.sequence_packing: {bool(value)}")


def _map_remove_padding(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """The role-level spelling of ``use_remove_padding``, on the strategies that pack."""
    value = role.pop("use_remove_padding")
    role_path = path.rsplit(".", 1)[0]
    args = role.get("strategy_args") or {}
    if args.get("strategy_name") not in PACKING_STRATEGIES:
        if value:
            problems.add(f"{path}={value!r}", f"roll packs rows in {', '.join(PACKING_STRATEGIES)} only")
        return
    config = args.setdefault("strategy_config", {}) or {}
    args["strategy_config"] = config
    _remove_padding_to_packing(value, config, role_path, problems, notes)


def _num_devices(role: dict[str, Any], path: str) -> int | None:
    mapping = role.get("device_mapping")
    return None if mapping is None else len(parse_device_mapping(mapping, f"{path}.device_mapping"))


# megatron-core TransformerConfig kernel switches ROLL passes through; roll's spelling is transformer_config_kwargs.
MEGATRON_PASSTHROUGH = (
    "apply_rope_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "bias_dropout_fusion",
    "moe_shared_expert_overlap",
)


def _map_megatron(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL's megatron extras: kernel switches pass through, ``bf16`` is the model dtype, and
    sequence_parallel without TP is switched off (ROLL's mcore_adapter warns and does the same)."""
    config, at = role["strategy_args"]["strategy_config"], f"{path}.strategy_config"
    for key in MEGATRON_PASSTHROUGH:
        if key in config:
            config.setdefault("transformer_config_kwargs", {})[key] = config.pop(key)
            notes.append(f"{at}.{key} -> {at}.transformer_config_kwargs.{key}")
    for key, value in (config.pop("additional_configs", None) or {}).items():  # ROLL: more mcore fields
        config.setdefault("transformer_config_kwargs", {})[key] = value
        notes.append(f"{at}.additional_configs.{key} -> {at}.transformer_config_kwargs.{key}")
    if "recompute_modules" in config:
        modules = config.pop("recompute_modules")
        if isinstance(modules, str):  # ROLL's comma-separated spelling of mcore's list
            modules = [m.strip() for m in modules.split(",") if m.strip()]
        config.setdefault("transformer_config_kwargs", {})["recompute_modules"] = modules
        notes.append(f"{at}.recompute_modules -> {at}.transformer_config_kwargs.recompute_modules: {modules}")
    if "bf16" in config:
        dtype = (role.get("model_args") or {}).get("dtype", "bf16")
        if bool(config.pop("bf16")) != (dtype == "bf16"):
            problems.add(f"{at}.bf16", f"remove it; model_args.dtype ({dtype}) sets the precision")
    if config.get("sequence_parallel") and config.get("tensor_model_parallel_size", 1) == 1:
        config["sequence_parallel"] = False
        notes.append(f"{at}.sequence_parallel: true needs TP > 1; set to false as ROLL does")


def map_engine(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL hands a vllm/sglang ``strategy_config`` to the engine as it is; roll's options are
    fields, and in a ROLL file any other key goes in ``engine_kwargs`` (checked by the installed
    engine when it starts; in roll's own files an unknown key stays an error)."""
    args = role.get("strategy_args")
    if not isinstance(args, dict) or args.get("strategy_name") not in ("vllm", "sglang"):
        return
    if not isinstance(args.get("strategy_config"), dict):
        return
    config, at = args["strategy_config"], f"{path}.strategy_config"
    known = {f.name for f in dataclasses.fields(STRATEGY_CONFIGS[args["strategy_name"]])}
    extra = [key for key in config if key not in known]
    if not extra:
        return
    engine_kwargs = config.setdefault("engine_kwargs", {})
    for key in extra:
        if engine_kwargs.setdefault(key, config[key]) != config[key]:
            problems.add(f"{at}.{key}={config[key]!r}", f"conflicts with engine_kwargs.{key}")
        config.pop(key)
    notes.append(f"{at}: {', '.join(extra)} -> engine_kwargs (engine arguments, as ROLL passes them)")


STRATEGY_MAPPERS: dict[str, Callable[..., None]] = {
    "fsdp2_train": _map_fsdp2,
    "fsdp2_infer": _map_fsdp2,
    "megatron_train": _map_megatron,
    "megatron_infer": _map_megatron,
}


def map_strategy(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    args = role["strategy_args"]
    if isinstance(args, dict) and args.get("strategy_name") == "fsdp2_infer":
        args["strategy_name"] = "fsdp2_train"  # mapped below like fsdp2_train
        notes.append(
            f"WARNING: {path}.strategy_name: fsdp2_infer -> fsdp2_train (roll has no forward-only FSDP2 "
            "strategy; the role only computes log-probs, its optimizer never steps)"
        )
    if not isinstance(args, dict) or not isinstance(args.get("strategy_config"), dict):
        return
    mapper = STRATEGY_MAPPERS.get(str(args.get("strategy_name")))
    if mapper is not None:
        mapper(role, path, problems, notes)


# ROLL's packing / dynamic-batching role keys -> roll's strategy_config keys (docs/packing.md).
PACKING_STRATEGIES = ("fsdp2_train", "megatron_train", "megatron_infer")
_BUDGETS = {
    "train": (
        "use_dynamic_batching_in_train",
        "max_tokens_per_microbatch_in_train",
        "max_tokens_per_microbatch",
    ),
    "infer": (
        "use_dynamic_batching_in_infer",
        "max_tokens_per_microbatch_in_infer",
        "infer_max_tokens_per_microbatch",
    ),
}
_PACKING_ARGS = {
    "max_packed_sequence_length_train": "max_tokens_per_microbatch",
    "max_packed_sequence_length_forward": "infer_max_tokens_per_microbatch",
}


def _roll_packing_keys(role: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Pop ROLL's packing keys of a role: ({roll strategy_config key: value}, [(key=value, advice)])."""
    wanted: dict[str, Any] = {}
    bad: list[tuple[str, str]] = []
    for switch, budget, key in _BUDGETS.values():
        on, tokens = role.pop(switch, None), role.pop(budget, None)
        if on and tokens is None:
            bad.append((f"{switch}={on!r}", f"set {budget} too (roll: strategy_config.{key})"))
        elif on:
            wanted[key] = tokens
    for side in ("train", "infer"):
        role.pop(f"sequence_length_round_in_{side}", None)  # roll rounds to 8 (x TP)
    args = dict(role.pop("sequence_packing_args", None) or {})
    if role.pop("use_sequence_packing", None):
        wanted["sequence_packing"] = True
        args.pop("algorithm", None)  # roll's planner is LPT bin packing
        for side in ("train", "forward"):  # roll's minimum is 1 (the budget decides the rest)
            if args.get(f"min_num_micro_batches_{side}") in (None, 1):
                args.pop(f"min_num_micro_batches_{side}", None)
        for name, key in _PACKING_ARGS.items():
            if args.get(name) is not None:
                wanted.setdefault(key, args.pop(name))
        bad += [
            (f"sequence_packing_args.{k}={v!r}", "remove it; roll has no such option")
            for k, v in args.items()
        ]
    return wanted, bad


def _map_packing(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL's dynamic batching and sequence packing onto roll's packing options."""
    wanted, bad = _roll_packing_keys(role)
    role_path = path.rsplit(".", 1)[0]
    for key, advice in bad:
        problems.add(f"{role_path}.{key}", advice)
    if not wanted:
        return
    args = role.get("strategy_args") or {}
    if args.get("strategy_name") not in PACKING_STRATEGIES:
        problems.add(f"{role_path} packing keys", f"roll packs in {', '.join(PACKING_STRATEGIES)} only")
        return
    config = args.setdefault("strategy_config", {}) or {}
    args["strategy_config"] = config
    for key, value in wanted.items():
        if config.setdefault(key, value) != value:
            problems.add(f"{role_path}: {key}={value!r}", f"conflicts with strategy_config.{key}")
        else:
            notes.append(f"{role_path}: ROLL packing keys -> strategy_config.{key}: {value!r}")


ROLE_MAPPERS: dict[str, Callable[..., None]] = {
    "num_gpus_per_worker": _map_num_gpus_per_worker,
    "strategy_args": map_strategy,
    "use_remove_padding": _map_remove_padding,
    **{
        key: _map_packing
        for key in (
            "use_dynamic_batching_in_train",
            "use_dynamic_batching_in_infer",
            "use_sequence_packing",
            "max_tokens_per_microbatch_in_train",
            "max_tokens_per_microbatch_in_infer",
            "sequence_length_round_in_train",
            "sequence_length_round_in_infer",
            "sequence_packing_args",
        )
    },
}
