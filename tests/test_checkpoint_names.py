"""Module names <-> checkpoint names (roll.models.checkpoint_names): what a sender holding
transformers modules puts on the wire equals what ``save_pretrained`` writes, bit for bit, and a
receiver holding them loads a checkpoint's per-expert tensors into its stacked experts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from tiny_models import safetensors_dir

from roll.models.checkpoint_names import CheckpointNames, _stack
from roll.models.weights import copy_into

SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SIZES, intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2
    ),
    "mixtral": lambda: transformers.MixtralConfig(**SIZES, intermediate_size=48, num_local_experts=4),
    "qwen2": lambda: transformers.Qwen2Config(**SIZES, intermediate_size=48),
}


@pytest.fixture(params=sorted(CONFIGS))
def saved(request, tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path)
    return request.param, model, safetensors_dir(tmp_path)


def test_to_checkpoint_is_what_save_pretrained_writes(saved):
    kind, model, checkpoint = saved
    sent = dict(CheckpointNames.of(model).to_checkpoint(model.state_dict().items()))
    sent = {n: t for n, t in sent.items() if n in checkpoint or n != "lm_head.weight"}  # a tied head
    assert sent.keys() == checkpoint.keys()
    assert all(torch.equal(sent[n], checkpoint[n]) for n in checkpoint)
    stacked = any(".experts.gate_up_proj" in n for n in model.state_dict())
    assert stacked == (kind != "qwen2")  # the MoE models do stack their experts


def test_a_receiver_loads_the_checkpoint_names_into_its_stacked_experts(saved):
    _, model, checkpoint = saved
    targets = {n: torch.zeros_like(t) for n, t in model.state_dict().items()}
    assert copy_into(targets, checkpoint.items(), CheckpointNames.of(model)) == len(checkpoint)
    for name, tensor in model.state_dict().items():
        assert torch.equal(targets[name], tensor), name


def test_unknown_names_and_conversions_are_named():
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["qwen3_moe"]())
    targets = model.state_dict(keep_vars=True)
    with pytest.raises(KeyError, match="unknown tensor 'model.layers.0.mlp.experts.9.up_proj.weight'"):
        copy_into(
            targets,
            [("model.layers.0.mlp.experts.9.up_proj.weight", torch.zeros(16, 32))],
            CheckpointNames.of(model),
        )
    transpose = SimpleNamespace(
        source_patterns=["mlp.experts.*.w.weight"],
        target_patterns=["mlp.experts.w"],
        operations=[SimpleNamespace(dim=1)],
    )
    with pytest.raises(ValueError, match="translates only stacked experts"):
        _stack(transpose, ["Transpose"])
