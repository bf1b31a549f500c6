"""MegatronConfig.validate (layout vs devices) and model_fit.check_model_fits (layout vs model).

Pure checks: no process groups, no megatron-core import (the family tables import only torch).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from roll.configs.errors import ConfigError
from roll.configs.strategy_configs import MegatronConfig
from roll.models.megatron import families, model_fit

PATH = "actor_train.strategy_args.strategy_config"
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200}


def dense(layers: int = 4, **kwargs) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(**{**TINY, **kwargs}, intermediate_size=128, num_hidden_layers=layers)


def moe(**kwargs) -> transformers.PretrainedConfig:
    base = {
        **TINY,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    return transformers.Qwen3MoeConfig(**{**base, **kwargs}, num_hidden_layers=4, head_dim=16)


FIRST = "num_layers_in_first_pipeline_stage"
LAST = "num_layers_in_last_pipeline_stage"


def error_key(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return info.value.path


# ------------------------------------------------------------------------------ validate
@pytest.mark.parametrize(
    "kwargs, devices, key",
    [
        ({"tensor_model_parallel_size": 0}, 1, "tensor_model_parallel_size"),
        (
            {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            6,
            "tensor_model_parallel_size",
        ),
        ({"tensor_model_parallel_size": 2, "context_parallel_size": 2}, 2, "tensor_model_parallel_size"),
        # 4 devices, TP 2 -> DP 2: EP x expert-TP = 4 x 2 does not divide TP x CP x DP = 4.
        ({"tensor_model_parallel_size": 2, "expert_model_parallel_size": 4}, 4, "expert_model_parallel_size"),
        ({"expert_model_parallel_size": 3}, 4, "expert_model_parallel_size"),
        ({"virtual_pipeline_model_parallel_size": 2}, 2, "virtual_pipeline_model_parallel_size"),
        ({"sequence_parallel": True}, 2, "sequence_parallel"),
        ({"recompute_granularity": "most"}, 1, "recompute_granularity"),
        ({"moe_token_dispatcher_type": "all2all"}, 1, "moe_token_dispatcher_type"),
        ({"overlap_param_gather": True}, 1, "overlap_param_gather"),
        ({"make_vocab_size_divisible_by": 0}, 1, "make_vocab_size_divisible_by"),
        ({"num_layers_in_first_pipeline_stage": 2}, 2, "num_layers_in_first_pipeline_stage"),
        ({"num_layers_in_last_pipeline_stage": 0}, 2, "num_layers_in_last_pipeline_stage"),
    ],
)
def test_validate_rejects(kwargs: dict, devices: int, key: str) -> None:
    """Field ranges and named values (checked as the loader builds the config), then the layout."""
    from roll.configs.ranges import check_fields

    def build_and_validate() -> None:
        config = MegatronConfig(**kwargs)
        check_fields(config, PATH)
        config.validate(devices, PATH)

    assert error_key(build_and_validate) == f"{PATH}.{key}"


@pytest.mark.parametrize(
    "kwargs, devices",
    [
        ({}, 1),
        ({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, 8),
        ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2),
        ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, 2),
        ({"expert_model_parallel_size": 4}, 4),
        (
            {
                "tensor_model_parallel_size": 2,
                "expert_model_parallel_size": 2,
                "expert_tensor_parallel_size": 1,
            },
            2,
        ),
    ],
)
def test_validate_accepts(kwargs: dict, devices: int) -> None:
    MegatronConfig(**kwargs).validate(devices, PATH)


# --------------------------------------------------------------------- check_model_fits
@pytest.mark.parametrize(
    "hf, kwargs, key",
    [
        # 4 layers do not split into 3 stages, nor into PP 2 x VPP 4 chunks.
        (dense(), {"pipeline_model_parallel_size": 3}, "pipeline_model_parallel_size"),
        (
            dense(),
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 4},
            "virtual_pipeline_model_parallel_size",
        ),
        # 4 layers + the embedding counted as a layer = 5: not divisible by 2.
        (
            dense(),
            {"pipeline_model_parallel_size": 2, "account_for_embedding_in_pipeline_split": True},
            "pipeline_model_parallel_size",
        ),
        (dense(), {"tensor_model_parallel_size": 4}, "tensor_model_parallel_size"),  # 2 kv heads
        (dense(), {"tensor_model_parallel_size": 8}, "tensor_model_parallel_size"),  # 4 heads
        # MoE-only options on a dense model.
        (dense(), {"expert_model_parallel_size": 2}, "expert_model_parallel_size"),
        (dense(), {"expert_tensor_parallel_size": 1}, "expert_tensor_parallel_size"),
        (dense(), {"moe_grouped_gemm": True}, "moe_grouped_gemm"),
        (dense(), {"moe_token_dispatcher_type": "alltoall"}, "moe_token_dispatcher_type"),
        (dense(), {"moe_layer_recompute": True}, "moe_layer_recompute"),
        (dense(), {"freeze_moe_router": True}, "freeze_moe_router"),
        # Uneven stages: 4 layers, first 3 of PP 3 leaves 1 for 2 stages; first + last > layers;
        # PP 2 with only the first given must leave exactly the rest to the last stage (it does),
        # but with VPP 2 the first stage's 3 layers do not split into 2 chunks.
        (dense(), {"pipeline_model_parallel_size": 3, "num_layers_in_first_pipeline_stage": 3}, FIRST),
        (
            dense(),
            {
                "pipeline_model_parallel_size": 2,
                "num_layers_in_first_pipeline_stage": 3,
                "num_layers_in_last_pipeline_stage": 2,
            },
            LAST,
        ),
        (
            dense(layers=5),
            {
                "pipeline_model_parallel_size": 2,
                "virtual_pipeline_model_parallel_size": 2,
                "num_layers_in_first_pipeline_stage": 3,
            },
            FIRST,
        ),
        # 4 experts over EP 3; expert ffn 32 over expert-TP 3.
        (moe(), {"expert_model_parallel_size": 3}, "expert_model_parallel_size"),
        (moe(moe_intermediate_size=30), {"expert_tensor_parallel_size": 4}, "expert_tensor_parallel_size"),
    ],
)
def test_check_model_fits_rejects(hf, kwargs: dict, key: str) -> None:
    assert (
        error_key(lambda: model_fit.check_model_fits(hf, MegatronConfig(**kwargs), PATH)) == f"{PATH}.{key}"
    )


@pytest.mark.parametrize(
    "hf, kwargs",
    [
        (dense(), {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
        (dense(), {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
        (
            dense(layers=3),
            {"pipeline_model_parallel_size": 2, "account_for_embedding_in_pipeline_split": True},
        ),
        (moe(), {"expert_model_parallel_size": 4, "moe_token_dispatcher_type": "alltoall"}),
        (moe(), {"expert_model_parallel_size": 2, "freeze_moe_router": True}),
        (dense(layers=3), {"pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": 2}),
        (
            dense(layers=6),
            {
                "pipeline_model_parallel_size": 3,
                "num_layers_in_first_pipeline_stage": 1,
                "num_layers_in_last_pipeline_stage": 1,
            },
        ),
        (moe(), {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "moe_grouped_gemm": True}),
    ],
)
def test_check_model_fits_accepts(hf, kwargs: dict) -> None:
    model_fit.check_model_fits(hf, MegatronConfig(**kwargs), PATH)


def test_unknown_model_type_names_the_model_path_and_lists_families() -> None:
    hf = transformers.GPT2Config()
    hf._name_or_path = "/models/gpt2"
    with pytest.raises(ConfigError) as info:
        model_fit.check_model_fits(hf, MegatronConfig(), PATH)
    assert info.value.path == "model_args.model_name_or_path"
    assert "'gpt2'" in info.value.message and "/models/gpt2" in info.value.message
    for model_type in ("llama", "mixtral", "qwen2", "qwen3", "qwen3_moe"):
        assert model_type in info.value.message


@pytest.mark.parametrize(
    "hf, what",
    [
        (dense(hidden_act="gelu"), "hidden_act"),
        (dense(use_sliding_window=True, sliding_window=64), "sliding_window"),
        (transformers.LlamaConfig(**TINY, attention_bias=True), "attention_bias"),
        (transformers.LlamaConfig(**TINY, mlp_bias=True), "mlp_bias"),
        (transformers.MixtralConfig(**TINY, sliding_window=128), "sliding_window"),
        (dense(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "RoPE scaling"),
    ],
)
def test_unsupported_hf_options(hf, what: str) -> None:
    with pytest.raises(ConfigError, match=what) as info:
        model_fit.check_model_fits(hf, MegatronConfig(), PATH)
    assert info.value.path == "model_args.model_name_or_path"


# ------------------------------------------------------------------- family -> megatron
def test_moe_routing_semantics() -> None:
    """norm_topk_prob=True (softmax, top-k, renormalise) is megatron's top-k-then-softmax; False
    (no renormalising) is pre-softmax. Mixtral always renormalises. mlp_only_layers are dense."""
    renorm = families.transformer_kwargs(moe(norm_topk_prob=True, mlp_only_layers=[1]))
    assert renorm["moe_router_pre_softmax"] is False
    assert renorm["moe_layer_freq"] == [1, 0, 1, 1]
    assert (renorm["num_moe_experts"], renorm["moe_router_topk"], renorm["moe_ffn_hidden_size"]) == (4, 2, 32)
    assert families.transformer_kwargs(moe(norm_topk_prob=False))["moe_router_pre_softmax"] is True
    mixtral = families.transformer_kwargs(
        transformers.MixtralConfig(**TINY, intermediate_size=48, num_local_experts=8, num_hidden_layers=2)
    )
    assert mixtral["moe_router_pre_softmax"] is False
    assert (mixtral["num_moe_experts"], mixtral["moe_ffn_hidden_size"], mixtral["moe_layer_freq"]) == (
        8,
        48,
        [1, 1],
    )


def test_attention_and_rope_options() -> None:
    qwen2 = families.transformer_kwargs(dense())
    assert qwen2["add_qkv_bias"] and not qwen2["qk_layernorm"]
    qwen3 = families.transformer_kwargs(transformers.Qwen3Config(**TINY, head_dim=32, num_hidden_layers=2))
    assert qwen3["qk_layernorm"] and not qwen3["add_qkv_bias"] and qwen3["kv_channels"] == 32
    llama3 = transformers.LlamaConfig(
        **TINY,
        max_position_embeddings=16384,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    assert families.rope_kwargs(llama3) == {
        "position_embedding_type": "rope",
        "rotary_base": 500000.0,
        "rope_scaling": True,
        "rope_scaling_factor": 8.0,
    }


@pytest.mark.parametrize(
    "vocab, tp, divisible_by, padded", [(200, 1, 128, 256), (272, 2, 128, 512), (256, 2, 128, 256)]
)
def test_vocab_padding(vocab: int, tp: int, divisible_by: int, padded: int) -> None:
    cfg = MegatronConfig(tensor_model_parallel_size=tp, make_vocab_size_divisible_by=divisible_by)
    assert families.padded_vocab_size(vocab, cfg) == padded


def test_transformer_config_from_hf_and_bad_passthrough_key() -> None:
    pytest.importorskip("megatron.core")
    from roll.models.megatron.model_builder import transformer_config_from_hf

    cfg = MegatronConfig(transformer_config_kwargs={"hidden_dropout": 0.1})
    config = transformer_config_from_hf(moe(), cfg, torch.bfloat16)
    assert (config.num_layers, config.num_query_groups, config.num_moe_experts) == (4, 2, 4)
    assert config.bf16 and config.params_dtype == torch.bfloat16 and config.hidden_dropout == 0.1
    bad = MegatronConfig(transformer_config_kwargs={"no_such_option": 1})
    key = error_key(lambda: transformer_config_from_hf(dense(), bad, torch.float32, PATH))
    assert key == f"{PATH}.transformer_config_kwargs"
