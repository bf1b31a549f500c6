"""alibaba/ROLL's ``strategy_config`` keys onto roll's options classes, one mapper per strategy
that has such keys (its row's ``roll_compat`` in ``roll.configs.strategies``). Each runs on a
role's plain data before the strict build and edits it in place; refusals go to ``problems``,
what was mapped or dropped to ``notes``:

>>> problems, notes = Problems(), []
>>> role = {"strategy_args": {"strategy_name": "fsdp2_train", "strategy_config": {"reduce_dtype": "bfloat16"}}}
>>> map_fsdp2(role, "actor_train.strategy_args", problems, notes)
>>> role["strategy_args"]["strategy_config"]
{'reduce_dtype': 'bf16', 'mixed_precision': True}
"""

from __future__ import annotations

from typing import Any

from roll.configs.device_mapping import parse_device_mapping


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


# ROLL's reduce_dtype spellings -> roll's FSDP2Config.reduce_dtype.
REDUCE_DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}


# ROLL's FSDP2 expert-parallel layout: the same keys in roll (FSDP2Config.ep_size, efsdp_size);
# ROLL's "unset" spellings (-1, and 1 for ep_size) are roll's defaults.
FSDP2_EXPERT_KEYS = {"ep_size": (None, 1, -1), "efsdp_size": (None, -1)}
# ROLL's FSDP2 memory and kernel options roll does not have: the same model and loss, other memory use.
FSDP2_DROPPED = {
    "apply_tiled_mlp": "ROLL runs the MLP in tiles to cut activation memory; roll runs it whole",
    "tiled_num_shards": "the tile count of apply_tiled_mlp; roll runs the MLP whole",
    "apply_expert_patch": "ROLL's MoE expert patch for FSDP2 (Ascend examples); roll uses transformers' MoE blocks",
    "moe_use_grouped_mm": "roll uses transformers' MoE blocks as they are",
    "wrap_policy": "roll shards each decoder layer and the whole model (embeddings and lm_head with the root)",
}


def map_fsdp2(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL's FSDP2 keys onto roll's FSDP2Config: mixed precision as the model dtype for
    parameters, gradient reduction in fp32 or bf16, CPU offload, ``use_remove_padding`` as sequence
    packing (``fsdp_size``, whose values mean other things in ROLL: ``map_fsdp_size``)."""
    config, at = role["strategy_args"]["strategy_config"], f"{path}.strategy_config"
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
        remove_padding_to_packing(config.pop("use_remove_padding"), config, at, problems, notes)
    for key, what in FSDP2_DROPPED.items():
        if key in config:
            notes.append(f"WARNING: {at}.{key}: {config.pop(key)!r} dropped; {what}")


def map_fsdp_size(role: dict[str, Any], path: str, notes: list[str]) -> None:
    """ROLL's ``fsdp_size`` on an fsdp2 role of a ROLL file (``path``: the role's): at most 1 (ROLL's
    default), -1 or at least the role's devices shard over every device, roll's ``fsdp_size: null``
    (the key is dropped with a note); a size below the device count is HSDP, the same key in roll,
    which checks that it divides the devices. Not for roll's own files: there 1 means full replicas."""
    config = _fsdp2_options(role)
    size = config.get("fsdp_size") if config is not None else None
    if not isinstance(size, int) or isinstance(size, bool):
        return  # absent, or a wrong type the strict build reports on the key
    devices = _num_devices(role, path)
    if size <= 1 or (devices is not None and size >= devices):
        del config["fsdp_size"]
        notes.append(
            f"{path}.strategy_args.strategy_config.fsdp_size: {size} -> null (ROLL shards over all "
            "the role's devices)"
        )


def _fsdp2_options(role: dict[str, Any]) -> dict[str, Any] | None:
    """The ``strategy_config`` mapping of an fsdp2 role's plain data (None for other roles)."""
    args = role.get("strategy_args")
    if not isinstance(args, dict) or args.get("strategy_name") not in ("fsdp2_train", "fsdp2_infer"):
        return None
    config = args.get("strategy_config")
    return config if isinstance(config, dict) else None


def map_expert_keys(role: dict[str, Any], path: str, notes: list[str]) -> None:
    """ROLL's ``ep_size``/``efsdp_size`` on an fsdp2 role of a ROLL file: roll's keys of the same
    meaning, less ROLL's "unset" spellings (-1; 1 for ep_size), and ``efsdp_size`` without expert
    parallelism, which shards nothing (dropped with a note)."""
    config, at = _fsdp2_options(role), f"{path}.strategy_args.strategy_config"
    if config is None:
        return
    for key, unset in FSDP2_EXPERT_KEYS.items():
        if key in config and config[key] in unset:
            config.pop(key)
    if "efsdp_size" in config and "ep_size" not in config:
        notes.append(
            f"{at}.efsdp_size: {config.pop('efsdp_size')!r} dropped; it shards experts only with ep_size > 1"
        )


def remove_padding_to_packing(
    value: Any, config: dict[str, Any], at: str, problems: Problems, notes: list[str]
) -> None:
    """ROLL's ``use_remove_padding``: rows packed without padding, roll's ``sequence_packing``."""
    if config.setdefault("sequence_packing", bool(value)) != bool(value):
        problems.add(f"{at}.use_remove_padding={value!r}", "conflicts with strategy_config.sequence_packing")
    else:
        notes.append(f"{at}.use_remove_padding: {value!r} -> strategy_config.sequence_packing: {bool(value)}")


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
    "cross_entropy_loss_fusion",  # megatron's fused loss; roll computes log-probs itself (no effect)
)


def map_megatron(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
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
