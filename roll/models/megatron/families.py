"""Model families the Megatron strategies load from Hugging Face checkpoints, keyed by ``model_type``.

A family says how an HF config becomes megatron-core ``TransformerConfig`` / ``GPTModel`` arguments
and which weight table (``weight_mapping``) converts its tensors. ``model_fit.check_model_fits``
checks that a model and a ``MegatronConfig`` layout fit together before anything is built.

>>> family = get_family(hf_config)                     # ConfigError for an unknown model_type
>>> kwargs = transformer_kwargs(hf_config)              # num_layers, hidden_size, ... MoE routing
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from roll.configs.errors import ConfigError
from roll.configs.strategy_configs import MegatronConfig
from roll.models.megatron import qwen3_5, qwen3_next
from roll.models.megatron import weight_mapping as wm
from roll.models.megatron.hf_fields import head_dim, rope_parameters
from roll.models.vision import is_vision_config, multimodal_config

MODEL_PATH = "model_args.model_name_or_path"


@dataclass(frozen=True)
class Family:
    """How one HF ``model_type`` maps onto megatron-core."""

    model_type: str
    tables: wm.LayerTables
    # q/k/v projections carry a bias (Qwen2); o_proj and the MLP never do.
    qkv_bias: bool = False
    # RMSNorm over each query/key head before RoPE (Qwen3).
    qk_layernorm: bool = False
    # MoE TransformerConfig kwargs from the HF config (None: dense family).
    moe_kwargs: Callable[[Any], dict[str, Any]] | None = None
    # Multi-latent attention kwargs (MLATransformerConfig) from the HF config (None: GQA attention).
    mla_kwargs: Callable[[Any], dict[str, Any]] | None = None
    # The weight tables for this HF config when they depend on it (DeepSeek's q_lora_rank).
    tables_fn: Callable[[Any], wm.LayerTables] | None = None
    # TransformerConfig kwargs of the architecture beyond GQA attention and MLPs (Qwen3-Next's
    # Gated DeltaNet layers, attention output gate, zero-centred norms) from the HF config.
    arch_kwargs: Callable[[Any], dict[str, Any]] | None = None
    # Layout rules of the family beyond heads, layers and experts per rank, given
    # (hf_config, megatron_cfg, strategy_config path); ConfigError naming the key.
    check_layout: Callable[[Any, MegatronConfig, str], None] | None = None
    # Checkpoint tensors (by name prefix) of modules roll does not build: skipped on load.
    skipped_prefixes: tuple[str, ...] = ()
    # megatron_infer can generate with it (kv_generate's cache holds attention K/V only; Gated
    # DeltaNet layers keep a recurrent state it has no place for).
    generates: bool = True
    # Why it cannot (the launch check's refusal, with what to generate with instead).
    no_generation: str = (
        "its linear-attention layers keep a recurrent state the KV cache has no place for; "
        "generate with vllm or sglang"
    )
    # Multimodal rotary positions (Qwen2.5-VL's mrope: 3-D position ids, ``mrope_section``).
    mrope: bool = False
    # Its checkpoints store each layer's experts stacked and transposed (weight_mapping.Stack).
    stacked_experts: tuple[wm.Stack, ...] = ()
    # A vision-language model whose forward takes packed (thd) rows, so sequence packing, token
    # budgets and context parallelism (roll.models.megatron.packed_vision); else padded rows only.
    packed_vision: bool = False
    # A vision-language model whose forward takes videos (pixel_values_videos, video_grid_thw).
    videos: bool = False

    def tables_for(self, hf: Any) -> wm.LayerTables:
        return self.tables_fn(hf) if self.tables_fn is not None else self.tables


# --------------------------------------------------------------------------------------- MoE
def _router_kwargs(num_experts: int, top_k: int, renormalize: bool) -> dict[str, Any]:
    """HF routers take softmax over all experts, then top-k, then (``renormalize``) divide by the sum
    of the k weights. megatron's ``pre_softmax=False`` (top-k on logits, softmax over the k) equals
    softmax-top-k-renormalize; ``pre_softmax=True`` is softmax-top-k without renormalising."""
    return {
        "num_moe_experts": num_experts,
        "moe_router_topk": top_k,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not renormalize,
        "moe_router_dtype": "fp32",
    }


def _qwen3_moe_kwargs(hf: Any) -> dict[str, Any]:
    step, dense_layers = hf.decoder_sparse_step, set(hf.mlp_only_layers or ())
    pattern = [
        int(i not in dense_layers and hf.num_experts > 0 and (i + 1) % step == 0)
        for i in range(hf.num_hidden_layers)
    ]
    return {
        **_router_kwargs(hf.num_experts, hf.num_experts_per_tok, bool(hf.norm_topk_prob)),
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_layer_freq": pattern,
    }


def _mixtral_kwargs(hf: Any) -> dict[str, Any]:
    if getattr(hf, "router_jitter_noise", 0.0):
        raise ConfigError(
            MODEL_PATH, "Mixtral router_jitter_noise > 0 is not supported by the Megatron strategies"
        )
    return {
        **_router_kwargs(hf.num_local_experts, hf.num_experts_per_tok, renormalize=True),
        "moe_ffn_hidden_size": hf.intermediate_size,
        "moe_layer_freq": [1] * hf.num_hidden_layers,
    }


def _deepseek_v3_kwargs(hf: Any) -> dict[str, Any]:
    """Sigmoid router over ``n_routed_experts`` with the score-correction bias (``expert_bias``),
    group-limited top-k, ``routed_scaling_factor``, one shared expert MLP; the first
    ``first_k_dense_replace`` layers are dense."""
    from roll.models.megatron import deepseek

    deepseek.check_router(hf)
    groups = hf.n_group or 1
    dense_layers = hf.first_k_dense_replace or 0
    return {
        "num_moe_experts": hf.n_routed_experts,
        "moe_router_topk": hf.num_experts_per_tok,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": hf.topk_group if groups > 1 else None,
        "moe_router_topk_scaling_factor": float(hf.routed_scaling_factor),
        "moe_router_pre_softmax": False,
        "moe_router_dtype": "fp32",
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": hf.moe_intermediate_size * hf.n_shared_experts,
        "moe_layer_freq": [int(i >= dense_layers) for i in range(hf.num_hidden_layers)],
    }


def _qwen3_vl_moe_kwargs(hf: Any) -> dict[str, Any]:
    """Qwen3-MoE's experts and layer pattern; Qwen3-VL-MoE's router always renormalises the top-k
    weights (its config has no ``norm_topk_prob``)."""
    step, dense_layers = hf.decoder_sparse_step, set(hf.mlp_only_layers or ())
    pattern = [
        int(i not in dense_layers and hf.num_experts > 0 and (i + 1) % step == 0)
        for i in range(hf.num_hidden_layers)
    ]
    return {
        **_router_kwargs(hf.num_experts, hf.num_experts_per_tok, renormalize=True),
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_layer_freq": pattern,
    }


def _qwen3_next_moe(hf: Any) -> dict[str, Any]:
    """Qwen3-MoE's routed experts and layer pattern, plus the gated shared expert."""
    qwen3_next.unsupported(hf)  # num_experts 0 or no shared expert: one line, not a KeyError
    return _qwen3_moe_kwargs(hf) | qwen3_next.shared_expert_kwargs(hf)


def _qwen3_5_moe(hf: Any) -> dict[str, Any]:
    """Qwen3.5-MoE: every layer routed (softmax, top-k, renormalised: its router always divides by
    the top-k sum) plus Qwen3-Next's gated shared expert."""
    qwen3_5.check_moe(hf)
    return {
        **_router_kwargs(hf.num_experts, hf.num_experts_per_tok, renormalize=True),
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_layer_freq": [1] * hf.num_hidden_layers,
        **qwen3_next.shared_expert_kwargs(hf),
    }


def _deepseek_v3_mla(hf: Any) -> dict[str, Any]:
    from roll.models.megatron import deepseek

    return deepseek.mla_kwargs(hf)


def _deepseek_v3_tables(hf: Any) -> wm.LayerTables:
    return wm.DEEPSEEK_V3 if hf.q_lora_rank else wm.DEEPSEEK_V3_NO_Q_LORA


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", wm.LLAMA),
        Family("qwen2", wm.QWEN2, qkv_bias=True),
        Family("qwen3", wm.QWEN3, qk_layernorm=True),
        Family("qwen3_moe", wm.QWEN3_MOE, qk_layernorm=True, moe_kwargs=_qwen3_moe_kwargs),
        Family("mixtral", wm.MIXTRAL, moe_kwargs=_mixtral_kwargs),
        Family(
            "qwen3_next",
            wm.QWEN3_NEXT,
            qk_layernorm=True,
            moe_kwargs=_qwen3_next_moe,
            arch_kwargs=qwen3_next.arch_kwargs,
            check_layout=qwen3_next.check_layout,
            skipped_prefixes=qwen3_next.SKIPPED_PREFIXES,
            generates=False,
        ),
        Family(
            "deepseek_v3",
            wm.DEEPSEEK_V3,
            moe_kwargs=_deepseek_v3_kwargs,
            mla_kwargs=_deepseek_v3_mla,
            tables_fn=_deepseek_v3_tables,
        ),
    )
}


def supported_model_types() -> list[str]:
    """The config.json model types the Megatron strategies build."""
    return sorted([*FAMILIES, *VISION_FAMILIES])


def language_config(hf_config: Any) -> Any:
    """The config of the language model: a vision-language config's ``text_config`` (Qwen2.5-VL
    keeps the text sizes there), else the config itself."""
    text = getattr(multimodal_config(hf_config), "text_config", None)  # Qwen3-Omni: the thinker's
    return text if text is not None and is_vision_config(hf_config) else hf_config


# Vision-language model types the Megatron strategies build, by config.json model_type: the family
# of the language model (``text_config``), a megatron-core GPTModel; the vision tower and merger are
# transformers' (roll.models.megatron.qwen2_5_vl).
VISION_FAMILIES: dict[str, Family] = {
    # Qwen2.5-VL's language model: Qwen2 with multimodal RoPE.
    "qwen2_5_vl": Family(
        "qwen2_5_vl_text",
        wm.QWEN2,
        qkv_bias=True,
        mrope=True,
        packed_vision=True,
        videos=True,
        generates=False,
        no_generation="its KV-cached loop takes no images; generate with vllm, as ROLL's Qwen2.5-VL files do",
    ),
    # Qwen3-VL's language model: Qwen3 with interleaved multimodal RoPE and deepstack (roll.models.megatron.qwen3_vl).
    "qwen3_vl": Family(
        "qwen3_vl_text",
        wm.QWEN3,
        qk_layernorm=True,
        mrope=True,
        packed_vision=True,
        videos=True,
        generates=False,
        no_generation="its KV-cached loop takes no images; generate with vllm, as ROLL's Qwen3-VL files do",
    ),
    # Qwen3-VL-MoE's language model: Qwen3-MoE with Qwen3-VL's mrope and deepstack; its checkpoints
    # stack each layer's experts, transposed (roll.models.megatron.stacked_experts).
    "qwen3_vl_moe": Family(
        "qwen3_vl_moe_text",
        wm.QWEN3_MOE,
        qk_layernorm=True,
        moe_kwargs=_qwen3_vl_moe_kwargs,
        mrope=True,
        packed_vision=True,
        videos=True,
        generates=False,
        no_generation="its KV-cached loop takes no images; generate with vllm, as ROLL's Qwen3-VL files do",
        stacked_experts=wm.QWEN3_VL_MOE_STACKS,
    ),
    # Qwen3.5 / Qwen3.5-MoE's language models: Qwen3-Next's hybrid layers (split Gated DeltaNet
    # projections), interleaved multimodal RoPE (roll.models.megatron.qwen3_5).
    "qwen3_5": Family(
        "qwen3_5_text",
        wm.QWEN3_5,
        qk_layernorm=True,
        arch_kwargs=qwen3_5.arch_kwargs,
        check_layout=qwen3_next.check_layout,
        skipped_prefixes=qwen3_5.SKIPPED_PREFIXES,
        generates=False,
        mrope=True,
        packed_vision=True,
    ),
    "qwen3_5_moe": Family(
        "qwen3_5_moe_text",
        wm.QWEN3_5_MOE,
        qk_layernorm=True,
        moe_kwargs=_qwen3_5_moe,
        arch_kwargs=qwen3_5.arch_kwargs,
        check_layout=qwen3_next.check_layout,
        skipped_prefixes=qwen3_5.SKIPPED_PREFIXES,
        generates=False,
        mrope=True,
        packed_vision=True,
    ),
    # Qwen3-Omni-MoE's thinker: Qwen3-MoE's layers (per-expert tensors under "thinker.model.") with
    # Qwen3-VL's mrope and deepstack, an audio tower beside the vision tower; talker and code2wav
    # are not built (roll.models.megatron.qwen3_omni).
    "qwen3_omni_moe": Family(
        "qwen3_omni_moe_text",
        wm.QWEN3_MOE,
        qk_layernorm=True,
        moe_kwargs=_qwen3_moe_kwargs,
        mrope=True,
        packed_vision=True,
        generates=False,
        no_generation="its KV-cached loop takes no images or audio; generate with vllm, as ROLL's Qwen3-Omni files do",
        skipped_prefixes=("talker.", "code2wav."),
    ),
}
# The module of each vision-language model type's megatron-core model: its ``vision_tensor_names``
# (hf_config) and ``MODEL_CLASS`` (a GPTModel subclass taking ``hf_config=``); imported when used.
VISION_MODULES: dict[str, str] = {
    "qwen2_5_vl": "roll.models.megatron.qwen2_5_vl",
    "qwen3_5": "roll.models.megatron.qwen3_5_model",
    "qwen3_5_moe": "roll.models.megatron.qwen3_5_model",
    "qwen3_omni_moe": "roll.models.megatron.qwen3_omni",
    "qwen3_vl": "roll.models.megatron.qwen3_vl",
    "qwen3_vl_moe": "roll.models.megatron.qwen3_vl",
}


def vision_module(hf_config: Any) -> Any:
    """The imported ``VISION_MODULES`` module of a vision-language config."""
    import importlib

    return importlib.import_module(VISION_MODULES[hf_config.model_type])


_LANGUAGE_FAMILIES = FAMILIES | {f.model_type: f for f in VISION_FAMILIES.values()}


def padded_rows_only(hf_config: Any) -> bool:
    """Whether ``hf_config``'s model runs on padded rows only: a vision-language model whose family
    has no ``packed_vision`` (its rope positions and vision features come from padded rows)."""
    family = VISION_FAMILIES.get(getattr(hf_config, "model_type", None))
    return is_vision_config(hf_config) and not (family is not None and family.packed_vision)


def get_family(hf_config: Any, path: str = MODEL_PATH) -> Family:
    """The family of ``hf_config.model_type`` (of its language model for a vision-language config);
    ConfigError naming the model path otherwise."""
    if getattr(hf_config, "model_type", None) in VISION_FAMILIES:
        hf_config = language_config(hf_config)
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _LANGUAGE_FAMILIES:
        where = getattr(hf_config, "_name_or_path", "") or "the checkpoint"
        raise ConfigError(
            path,
            f"model_type {model_type!r} of {where} is not supported by the Megatron strategies; "
            f"supported: {supported_model_types()}",
        )
    return _LANGUAGE_FAMILIES[model_type]


# ---------------------------------------------------------------------------- HF config fields
# megatron-core's llama3 RoPE scaling hard-codes these (RotaryEmbedding._apply_scaling).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_kwargs(hf: Any) -> dict[str, Any]:
    """GPTModel's RoPE arguments; ConfigError for scalings megatron-core cannot reproduce."""
    hf = language_config(hf)
    rope = rope_parameters(hf)
    kwargs: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": rope["rope_theta"]}
    if get_family(hf).mla_kwargs is not None:
        return kwargs  # multi-latent attention applies its own RoPE (checked by its mla_kwargs)
    # RoPE on the first part of each head only (Qwen3-Next's and Qwen3.5's partial_rotary_factor).
    percent = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if percent is not None and float(percent) != 1.0:
        kwargs["rotary_percent"] = float(percent)
    if get_family(hf).mrope:
        return {**kwargs, "position_embedding_type": "mrope"}  # mrope_section: transformer_kwargs
    if rope["rope_type"] == "default":
        return kwargs
    if rope["rope_type"] == "llama3" and all(float(rope.get(k, -1)) == v for k, v in _LLAMA3_FIXED.items()):
        return {**kwargs, "rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
    raise ConfigError(
        MODEL_PATH,
        f"RoPE scaling {rope} in config.json is not supported by the Megatron strategies "
        f"(supported: default, and llama3 with {_LLAMA3_FIXED})",
    )


def _sliding_window(hf: Any) -> Any:
    """Qwen configs carry ``sliding_window`` but use it only with ``use_sliding_window``; Mixtral uses
    it whenever it is set."""
    if hasattr(hf, "use_sliding_window"):
        return getattr(hf, "sliding_window", None) if hf.use_sliding_window else None
    return getattr(hf, "sliding_window", None)


def check_supported(hf: Any, family: Family) -> None:
    """HF options outside what the family's megatron-core model reproduces."""
    unsupported = (
        ("hidden_act", getattr(hf, "hidden_act", "silu"), lambda v: v != "silu"),
        ("attention_bias", getattr(hf, "attention_bias", False), bool),
        ("mlp_bias", getattr(hf, "mlp_bias", False), bool),
        ("sliding_window", _sliding_window(hf), lambda v: v is not None),
    )
    for key, value, bad in unsupported:
        if bad(value):
            raise ConfigError(
                MODEL_PATH,
                f"config.json {key}={value!r} is not supported for {family.model_type} by the Megatron strategies",
            )
    rope_kwargs(hf)
    for check in (family.mla_kwargs, family.moe_kwargs, family.arch_kwargs):
        if check is not None:
            check(hf)


def transformer_kwargs(hf: Any) -> dict[str, Any]:
    """The model-shape part of megatron-core's TransformerConfig for this HF config."""
    hf = language_config(hf)
    family = get_family(hf)
    check_supported(hf, family)
    kwargs = {
        "num_layers": hf.num_hidden_layers,
        "hidden_size": hf.hidden_size,
        # None (megatron's default) for a model whose layers are all MoE and which has no dense
        # width (Qwen3.5-MoE's config has no intermediate_size).
        "ffn_hidden_size": getattr(hf, "intermediate_size", None),
        "num_attention_heads": hf.num_attention_heads,
        "num_query_groups": hf.num_key_value_heads,
        "kv_channels": head_dim(hf),
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": family.qkv_bias,
        "qk_layernorm": family.qk_layernorm,
        "hidden_dropout": 0.0,
        "attention_dropout": float(getattr(hf, "attention_dropout", 0.0) or 0.0),
        "init_method_std": getattr(hf, "initializer_range", 0.02),
    }
    if family.mrope:  # Qwen3.5's arch_kwargs give it where config.json may leave it out
        kwargs["mrope_section"] = list(rope_parameters(hf).get("mrope_section", ()))
    if family.moe_kwargs is not None:
        kwargs.update(family.moe_kwargs(hf))
    if family.mla_kwargs is not None:
        kwargs.update(family.mla_kwargs(hf))
    if family.arch_kwargs is not None:
        kwargs.update(family.arch_kwargs(hf))
    return kwargs


def padded_vocab_size(vocab_size: int, megatron_cfg: MegatronConfig) -> int:
    """The vocab rounded up to a multiple of ``make_vocab_size_divisible_by * TP`` (Megatron-LM's rule)."""
    multiple = megatron_cfg.make_vocab_size_divisible_by * megatron_cfg.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def conversion_info(hf: Any, megatron_cfg: MegatronConfig) -> wm.ConversionInfo:
    """What the weight conversion needs to know about this model (see ``weight_mapping``)."""
    vision = _vision_tensor_names(hf)
    hf_config, hf = hf, language_config(hf)
    family = get_family(hf)
    moe = family.moe_kwargs(hf) if family.moe_kwargs else {}
    arch = family.arch_kwargs(hf) if family.arch_kwargs else {}
    linear = tuple(bool(x) for x in arch.get("linear_attention_freq", ()))
    return wm.ConversionInfo(
        model_type=family.model_type,
        tables=family.tables_for(hf),
        vocab_size=hf.vocab_size,
        padded_vocab_size=padded_vocab_size(hf.vocab_size, megatron_cfg),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        num_layers=hf.num_hidden_layers,
        num_experts=moe.get("num_moe_experts", 0),
        moe_layers=tuple(bool(x) for x in moe.get("moe_layer_freq", [0] * hf.num_hidden_layers)),
        heads=wm.HeadLayout(
            head_dim(hf), hf.num_attention_heads // hf.num_key_value_heads, _linear_heads(arch)
        ),
        extra_layers=_mtp_layers(hf),
        linear_layers=linear if any(linear) else (),
        skipped_prefixes=family.skipped_prefixes,
        vision_names=vision,
        hf_prefixes=_hf_prefixes(hf_config) if vision else (),
        stacked=(
            wm.StackedNames(
                family.stacked_experts, moe["num_moe_experts"], hf.hidden_size, moe["moe_ffn_hidden_size"]
            )
            if family.stacked_experts
            else None
        ),
    )


def _vision_tensor_names(hf: Any) -> tuple[str, ...]:
    """The HF names of a vision-language model's vision tower tensors (``visual.*``), the same in the
    checkpoint and in roll's megatron model; () for a text model."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in VISION_FAMILIES:
        return ()
    return vision_module(hf).vision_tensor_names(hf)


def _hf_prefixes(hf: Any) -> tuple[tuple[str, str], ...]:
    """(roll's name prefix, the HF name prefix) pairs of a vision-language model's tensors: its
    module's ``HF_PREFIXES`` (Qwen3-Omni's ``thinker.``), else transformers 5's module names."""
    return getattr(vision_module(hf), "HF_PREFIXES", wm.VL_PREFIXES)


def _linear_heads(arch: dict[str, Any]) -> wm.LinearHeads | None:
    """The Gated DeltaNet head sizes of a model with such layers (TransformerConfig kwargs)."""
    if arch.get("experimental_attention_variant") != "gated_delta_net":
        return None
    return wm.LinearHeads(
        key_heads=arch["linear_num_key_heads"],
        value_heads=arch["linear_num_value_heads"],
        key_dim=arch["linear_key_head_dim"],
        value_dim=arch["linear_value_head_dim"],
    )


def _mtp_layers(hf: Any) -> int:
    """Multi-token-prediction layers stored after the decoder layers (DeepSeek-V3's
    ``num_nextn_predict_layers``); roll does not build them and skips their tensors on load."""
    return int(getattr(hf, "num_nextn_predict_layers", 0) or 0)
