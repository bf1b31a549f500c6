"""DeepSeek-V3 (HF ``model_type: deepseek_v3``) on megatron-core: what of its config.json roll
reproduces, as megatron-core ``MLATransformerConfig`` / MoE router arguments.

- Multi-latent attention (MLA): ``q_lora_rank`` (or none: a plain ``q_proj``), ``kv_lora_rank``,
  ``qk_nope_head_dim`` / ``qk_rope_head_dim`` / ``v_head_dim``, RoPE on the decoupled
  ``qk_rope_head_dim`` part with DeepSeek's interleaved pairs (``rope_interleave: true``;
  megatron's MLA de-interleaves the same way), RoPE ``default`` or ``yarn`` (factor,
  original_max_position_embeddings, beta_fast / beta_slow, mscale / mscale_all_dim, including
  the softmax-scale correction ``mscale(factor, mscale_all_dim)^2``).
- MoE: sigmoid scores plus the score-correction bias (``e_score_correction_bias`` ->
  megatron's ``expert_bias``) for choosing experts, the unbiased scores as weights, group-limited
  top-k (``n_group`` / ``topk_group``), ``norm_topk_prob``, ``routed_scaling_factor``, shared
  experts (``n_shared_experts`` x ``moe_intermediate_size``), the first ``first_k_dense_replace``
  layers dense.
- Not built: the multi-token-prediction layers (``num_nextn_predict_layers``); their tensors
  (``model.layers.{num_hidden_layers + i}.*``) are skipped on load with a log line and not
  exported.

Everything else that changes the math is refused with one ``ConfigError`` naming the
config.json key (``unsupported``).
"""

from __future__ import annotations

from typing import Any

from roll.configs.errors import ConfigError
from roll.models.megatron.hf_fields import rope_parameters

MODEL_PATH = "model_args.model_name_or_path"


def _refuse(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(
        MODEL_PATH,
        f"config.json {key}={value!r} is not supported for deepseek_v3 by the Megatron strategies: {why}",
    )


def _yarn_kwargs(hf: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """megatron's YarnRotaryEmbedding arguments equal to transformers' yarn for DeepSeek."""
    for key, ok in (("attention_factor", lambda v: v is None), ("truncate", lambda v: v in (None, True))):
        if not ok(rope.get(key)):
            raise _refuse(f"rope_scaling.{key}", rope.get(key), "megatron-core's YaRN has no such option")
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise _refuse("rope_scaling.original_max_position_embeddings", original, "YaRN needs it")
    factor = rope.get("factor") or hf.max_position_embeddings / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    # transformers scales cos/sin by mscale(f, mscale) / mscale(f, mscale_all_dim) only when both
    # are set, else by mscale(f); megatron always takes the ratio (mscale_all_dim 0 -> 1). They agree
    # except for mscale_all_dim without mscale.
    if mscale_all_dim and not mscale:
        raise _refuse("rope_scaling.mscale", mscale, "mscale_all_dim without mscale scales RoPE differently")
    both = bool(mscale and mscale_all_dim)
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": float(factor),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(rope.get("beta_fast") or 32),
        "beta_slow": float(rope.get("beta_slow") or 1),
        "mscale": float(mscale) if both else 1.0,
        "mscale_all_dim": float(mscale_all_dim or 0.0),
    }


def mla_kwargs(hf: Any) -> dict[str, Any]:
    """MLATransformerConfig arguments for the attention of ``hf`` (ConfigError where unsupported)."""
    unsupported(hf)
    rope = rope_parameters(hf)
    kwargs: dict[str, Any] = {
        "multi_latent_attention": True,
        "q_lora_rank": hf.q_lora_rank or None,
        "kv_lora_rank": hf.kv_lora_rank,
        "qk_head_dim": hf.qk_nope_head_dim,
        "qk_pos_emb_head_dim": hf.qk_rope_head_dim,
        "v_head_dim": hf.v_head_dim,
        "kv_channels": hf.v_head_dim,
        # megatron's MLA builds q_layernorm / kv_layernorm only with qk_layernorm (the latents' norms).
        "qk_layernorm": True,
        "rotary_base": float(rope["rope_theta"]),
    }
    if rope["rope_type"] == "default":
        # No YaRN: the softmax scale is 1/sqrt(qk_head_dim) (mscale(1, .) = 1).
        return {**kwargs, "rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}
    if rope["rope_type"] == "yarn":
        return {**kwargs, **_yarn_kwargs(hf, rope)}
    raise _refuse("rope_scaling.rope_type", rope["rope_type"], "supported: default, yarn")


def check_router(hf: Any) -> None:
    """The router options megatron-core's sigmoid top-k router reproduces exactly."""
    unsupported(hf)
    top_k, groups = hf.num_experts_per_tok, hf.n_group or 1
    if top_k > 1 and not hf.norm_topk_prob:
        # megatron divides sigmoid top-k weights by their sum whenever top-k > 1.
        raise _refuse("norm_topk_prob", hf.norm_topk_prob, "megatron-core always renormalises sigmoid top-k")
    if hf.n_routed_experts % groups:
        raise _refuse("n_group", groups, f"does not divide n_routed_experts={hf.n_routed_experts}")
    if groups > 1:
        topk_group = hf.topk_group
        if not topk_group or topk_group > groups:
            raise _refuse("topk_group", topk_group, f"must be 1..n_group={groups}")
        # transformers scores a group by its top-2 experts; megatron by its top (top_k // topk_group).
        if top_k // topk_group != 2:
            raise _refuse(
                "topk_group",
                topk_group,
                f"groups are scored by their top-2 experts in transformers and by the top "
                f"num_experts_per_tok // topk_group = {top_k // topk_group} in megatron-core",
            )
    if (hf.n_shared_experts or 0) < 1:
        raise _refuse("n_shared_experts", hf.n_shared_experts, "at least one shared expert is expected")


def unsupported(hf: Any) -> None:
    """ConfigError naming the first config.json key whose value roll's DeepSeek-V3 does not run."""
    checks = (
        (
            "rope_interleave",
            getattr(hf, "rope_interleave", True),
            lambda v: v is False,
            "megatron's MLA rotates interleaved pairs (rope_interleave: true) only",
        ),
        (
            "quantization_config",
            getattr(hf, "quantization_config", None),
            lambda v: v is not None,
            "convert the FP8 checkpoint to bf16 first",
        ),
        (
            "scoring_func",
            getattr(hf, "scoring_func", "sigmoid"),
            lambda v: v != "sigmoid",
            "DeepSeek-V3 routes with sigmoid scores",
        ),
        (
            "topk_method",
            getattr(hf, "topk_method", "noaux_tc"),
            lambda v: v not in (None, "noaux_tc"),
            "DeepSeek-V3 routes with noaux_tc (score-correction bias)",
        ),
        (
            "ep_size",
            getattr(hf, "ep_size", 1),
            lambda v: v not in (None, 1),
            "set expert_model_parallel_size in strategy_config instead",
        ),
    )
    for key, value, bad, why in checks:
        if bad(value):
            raise _refuse(key, value, why)
