"""Whether a model and a ``MegatronConfig`` layout fit together, checked before anything is built:
layers per pipeline chunk (evenly, by first/last stage sizes, or by ``pipeline_model_parallel_layout``),
heads per TP rank, experts per EP rank, MoE-only options, and each family's own rules.

>>> check_model_fits(hf_config, megatron_cfg, "actor_train.strategy_args.strategy_config")
"""

from __future__ import annotations

from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.strategy_configs import MegatronConfig
from roll.models.megatron.families import (
    VISION_MODULES,
    check_supported,
    get_family,
    language_config,
    vision_module,
)

STRATEGY_PATH = "strategy_args.strategy_config"

_MOE_ONLY = (
    ("expert_model_parallel_size", lambda c: c.expert_model_parallel_size > 1),
    ("expert_tensor_parallel_size", lambda c: c.expert_tensor_parallel_size is not None),
    ("moe_grouped_gemm", lambda c: c.moe_grouped_gemm),
    ("moe_token_dispatcher_type", lambda c: c.moe_token_dispatcher_type != "allgather"),
    ("moe_layer_recompute", lambda c: c.moe_layer_recompute),
    ("freeze_moe_router", lambda c: c.freeze_moe_router),
)


def _divides(size: int, value: int, what: str, key: str) -> None:
    if value % size:
        raise ConfigError(key, f"{size} does not divide the model's {what} ({value})")


def _check_pipeline_split(hf: Any, cfg: MegatronConfig, path: str) -> None:
    pp, vpp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size or 1
    layout = cfg.pipeline_layout()
    if layout is not None:
        if layout.decoder_layers != hf.num_hidden_layers:
            raise ConfigError(
                f"{path}.pipeline_model_parallel_layout",
                f"places {layout.decoder_layers} decoder layers (t), the model has {hf.num_hidden_layers}",
            )
        return
    first, last = cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        _check_uneven_split(hf.num_hidden_layers, pp, vpp, first, last, path)
        return
    layers = hf.num_hidden_layers
    extra = int(cfg.account_for_embedding_in_pipeline_split) + int(cfg.account_for_loss_in_pipeline_split)
    if (layers + extra) % (pp * vpp):
        key = "virtual_pipeline_model_parallel_size" if vpp > 1 else "pipeline_model_parallel_size"
        counted = f"{layers} layers" + (f" + {extra} (embedding/loss counted as layers)" if extra else "")
        raise ConfigError(
            f"{path}.{key}", f"the model's {counted} do not split evenly into PP x VPP = {pp} x {vpp} chunks"
        )


def _check_uneven_split(
    layers: int, pp: int, vpp: int, first: int | None, last: int | None, path: str
) -> None:
    """First/last stages of the given sizes; the middle stages share the rest evenly (and every
    stage's layers split into VPP chunks)."""
    fixed = {k: v for k, v in (("first", first), ("last", last)) if v is not None}
    middle_stages = pp - len(fixed)
    rest = layers - sum(fixed.values())
    key = f"{path}.num_layers_in_{'last' if 'last' in fixed else 'first'}_pipeline_stage"
    if rest < 0 or (middle_stages == 0 and rest) or (middle_stages and rest % (middle_stages * vpp)):
        raise ConfigError(
            key,
            f"the model's {layers} layers cannot split into PP={pp} stages with "
            + ", ".join(f"{n} {v}" for n, v in fixed.items())
            + f" layers: {rest} remain for {middle_stages} middle stage(s) x VPP {vpp}",
        )
    for name, value in fixed.items():
        if value % vpp:
            raise ConfigError(
                f"{path}.num_layers_in_{name}_pipeline_stage",
                f"{value} layers do not split into VPP={vpp} chunks",
            )


def check_model_fits(hf_config: Any, megatron_cfg: MegatronConfig, path: str = STRATEGY_PATH) -> None:
    """Check the model against the parallel layout; ConfigError naming the ``strategy_config`` key.

    ``MegatronConfig.validate`` checks the layout against the devices; this checks it against the
    model (layers per pipeline chunk, heads per TP rank, experts per EP rank, MoE-only options).
    """
    if getattr(hf_config, "model_type", None) in VISION_MODULES:
        vision_check = getattr(vision_module(hf_config), "check_layout", None)
        if vision_check is not None:  # e.g. Qwen3-VL: its deepstack layers on the first stage
            vision_check(hf_config, megatron_cfg, path)
    hf_config = language_config(hf_config)
    family = get_family(hf_config)
    check_supported(hf_config, family)
    cfg, tp = megatron_cfg, megatron_cfg.tensor_model_parallel_size
    _check_pipeline_split(hf_config, cfg, path)
    if family.check_layout is not None:
        family.check_layout(hf_config, cfg, path)
    tp_key = f"{path}.tensor_model_parallel_size"
    _divides(tp, hf_config.num_attention_heads, "num_attention_heads", tp_key)
    _divides(tp, hf_config.num_key_value_heads, "num_key_value_heads", tp_key)
    if family.moe_kwargs is None:
        _divides(tp, hf_config.intermediate_size, "intermediate_size", tp_key)
        for key, is_set in _MOE_ONLY:
            if is_set(cfg):
                raise ConfigError(
                    f"{path}.{key}", f"is an MoE option but model_type {family.model_type!r} has no experts"
                )
        return
    moe = family.moe_kwargs(hf_config)
    if not all(moe["moe_layer_freq"]):
        _divides(tp, hf_config.intermediate_size, "intermediate_size", tp_key)
    ep, etp = cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size or tp
    _divides(ep, moe["num_moe_experts"], "number of experts", f"{path}.expert_model_parallel_size")
    etp_key = f"{path}.expert_tensor_parallel_size" if cfg.expert_tensor_parallel_size else tp_key
    _divides(etp, moe["moe_ffn_hidden_size"], "expert intermediate size", etp_key)
    if moe.get("moe_shared_expert_intermediate_size"):
        _divides(tp, moe["moe_shared_expert_intermediate_size"], "shared expert intermediate size", tp_key)
