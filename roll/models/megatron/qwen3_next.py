"""Qwen3-Next (HF ``model_type: qwen3_next``) on megatron-core: what of its config.json roll
reproduces, as megatron-core ``TransformerConfig`` arguments, and the layouts it runs under.

- Hybrid layers (``layer_types``, or every ``full_attention_interval``-th layer full): Gated
  DeltaNet linear attention (``linear_num_key_heads`` / ``linear_num_value_heads`` heads of
  ``linear_key_head_dim`` / ``linear_value_head_dim``, a causal conv of ``linear_conv_kernel_dim``;
  ``roll.models.megatron.gated_delta_net``) and gated full attention (``q_proj`` twice as wide,
  half of it a sigmoid output gate: megatron's ``attention_output_gate``; ``q_norm`` / ``k_norm``;
  RoPE on the first ``partial_rotary_factor`` of each head).
- Zero-centred RMSNorms (weight stored as its offset from 1: ``layernorm_zero_centered_gamma``);
  the Gated DeltaNet output norm keeps a plain weight.
- MoE: softmax top-k routing (``norm_topk_prob``) over ``num_experts``, a shared expert MLP of
  ``shared_expert_intermediate_size`` scaled by a sigmoid gate (``moe_shared_expert_gate``);
  ``mlp_only_layers`` / ``decoder_sparse_step`` choose dense layers as in Qwen3-MoE.
- Not built: the multi-token-prediction module (``mtp.*`` tensors), skipped on load with a log
  line and not exported.

Context parallelism runs the Gated DeltaNet layers head-parallel (``gdn_context_parallel``).
Refused with one ``ConfigError`` naming the key: a TP size, or TP x CP, that does not divide the
linear-attention key heads, and config.json values the model above does not reproduce.
"""

from __future__ import annotations

from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.strategy_configs import MegatronConfig

MODEL_PATH = "model_args.model_name_or_path"
LINEAR, FULL = "linear_attention", "full_attention"
# Checkpoint tensors of modules roll does not build.
SKIPPED_PREFIXES = ("mtp.",)


def _refuse(key: str, value: Any, why: str, model_type: str = "qwen3_next") -> ConfigError:
    return ConfigError(
        MODEL_PATH,
        f"config.json {key}={value!r} is not supported for {model_type} by the Megatron strategies: {why}",
    )


def layer_types(hf: Any) -> list[str]:
    """``linear_attention`` / ``full_attention`` per layer of an HF config object."""
    return hybrid_layer_types(
        getattr(hf, "layer_types", None), int(getattr(hf, "full_attention_interval", 4)), hf.num_hidden_layers
    )


def hybrid_layer_types(types: list[str] | None, interval: int, layers: int) -> list[str]:
    """config.json's ``layer_types``, or (when it has none, as transformers fills it) every
    ``full_attention_interval``-th layer full attention and the others linear."""
    if types:
        return list(types)
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]


def linear_layers(hf: Any) -> tuple[bool, ...]:
    return tuple(t == LINEAR for t in layer_types(hf))


def check_hybrid(hf: Any, model_type: str = "qwen3_next") -> None:
    """ConfigError naming the first config.json key of the hybrid attention (layer types, linear
    heads) that roll's Gated DeltaNet layers do not run; Qwen3.5 shares them."""
    types = layer_types(hf)
    if len(types) != hf.num_hidden_layers or set(types) - {LINEAR, FULL}:
        raise _refuse("layer_types", types, f"one of {LINEAR!r} / {FULL!r} per layer is expected", model_type)
    if hf.linear_num_value_heads % hf.linear_num_key_heads:
        raise _refuse(
            "linear_num_value_heads",
            hf.linear_num_value_heads,
            f"must be a multiple of linear_num_key_heads={hf.linear_num_key_heads}",
            model_type,
        )


def unsupported(hf: Any) -> None:
    """ConfigError naming the first config.json key whose value roll's Qwen3-Next does not run."""
    check_hybrid(hf)
    if not hf.num_experts:
        raise _refuse(
            "num_experts", hf.num_experts, "roll builds Qwen3-Next's MoE layers only (num_experts > 0)"
        )
    if not getattr(hf, "shared_expert_intermediate_size", 0):
        raise _refuse(
            "shared_expert_intermediate_size",
            getattr(hf, "shared_expert_intermediate_size", None),
            "Qwen3-Next's MoE layers have a gated shared expert",
        )


def shared_expert_kwargs(hf: Any) -> dict[str, Any]:
    """The gated shared expert's TransformerConfig kwargs (the routed experts are Qwen3-MoE's)."""
    return {
        "moe_shared_expert_intermediate_size": hf.shared_expert_intermediate_size,
        "moe_shared_expert_gate": True,
    }


def arch_kwargs(hf: Any) -> dict[str, Any]:
    """The TransformerConfig kwargs of the hybrid attention and the zero-centred norms."""
    unsupported(hf)
    return hybrid_kwargs(hf)


def hybrid_kwargs(hf: Any) -> dict[str, Any]:
    """The TransformerConfig kwargs of the Gated DeltaNet / gated attention layers and the
    zero-centred norms (checked by ``check_hybrid``)."""
    return {
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [int(x) for x in linear_layers(hf)],
        "linear_conv_kernel_dim": hf.linear_conv_kernel_dim,
        "linear_key_head_dim": hf.linear_key_head_dim,
        "linear_value_head_dim": hf.linear_value_head_dim,
        "linear_num_key_heads": hf.linear_num_key_heads,
        "linear_num_value_heads": hf.linear_num_value_heads,
        "attention_output_gate": True,
        "layernorm_zero_centered_gamma": True,
    }


def check_layout(hf: Any, cfg: MegatronConfig, path: str) -> None:
    """What the Gated DeltaNet layers need of the parallel layout (ConfigError naming the key):
    each TP rank's key heads split over its CP ranks (``gdn_context_parallel``: a CP rank runs whole
    sequences on ``1 / (TP x CP)`` of the heads)."""
    tp, cp = cfg.tensor_model_parallel_size, cfg.context_parallel_size
    heads = hf.linear_num_key_heads
    if heads % tp:
        raise ConfigError(
            f"{path}.tensor_model_parallel_size",
            f"{tp} does not divide the model's linear_num_key_heads ({heads})",
        )
    if heads % (tp * cp):
        raise ConfigError(
            f"{path}.context_parallel_size",
            f"{cp}: TP x CP = {tp} x {cp} does not divide the model's linear_num_key_heads ({heads}); "
            "the Gated DeltaNet layers split each TP rank's heads over its CP ranks",
        )
