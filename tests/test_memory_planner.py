"""Memory planner (roll/planner): size formulas against transformers, state bytes, colocation."""

from __future__ import annotations

import pytest
import torch
import transformers

from roll.configs.errors import ConfigError
from roll.planner.model_shape import FAMILY_TRAITS, shape_from_config

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=128,
)
CASES = {
    "Qwen2Config": dict(TINY, tie_word_embeddings=False),
    "LlamaConfig": dict(TINY, tie_word_embeddings=True),
    "Qwen3Config": dict(TINY, head_dim=24, tie_word_embeddings=False),
    "Qwen3MoeConfig": dict(
        TINY,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
    "MixtralConfig": dict(TINY, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
}


@pytest.mark.parametrize("class_name", sorted(CASES))
def test_param_count_matches_transformers(class_name: str) -> None:
    config = getattr(transformers, class_name)(**CASES[class_name])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())
    assert shape_from_config(config.to_dict()).total_params() == expected


def test_families_match_megatron_families() -> None:
    from roll.models.megatron.families import FAMILIES

    assert set(FAMILY_TRAITS) == set(FAMILIES)


def test_unknown_family_names_the_key() -> None:
    with pytest.raises(ConfigError, match="actor_train.model_args.model_name_or_path: model_type 'gpt2'"):
        shape_from_config({"model_type": "gpt2"}, "actor_train.model_args.model_name_or_path")
