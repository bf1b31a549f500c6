"""roll.models.lora: the LoRA layer against a hand computation, target matching, freezing, merged
and adapter state on a tiny Qwen2."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model
from torch import nn

from roll.configs.errors import ConfigError
from roll.models.loading import decoder_layers
from roll.models.lora import (
    ADAPTER_NAMES,
    LoRALinear,
    apply_lora,
    hf_name,
    lora_scales,
    merge,
    merged_stream,
)

torch.set_num_threads(1)


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain wrapped model's state_dict as the un-wrapped model's, LoRA targets merged."""
    return {name: t.detach() for name, t in merged_stream(model.state_dict().items(), lora_scales(model))}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in model.state_dict().items() if n.rsplit(".", 1)[-1] in ADAPTER_NAMES}


def _layer(rank: int = 3, alpha: float = 6.0) -> tuple[nn.Linear, LoRALinear]:
    torch.manual_seed(0)
    base = nn.Linear(5, 4)
    reference = nn.Linear(5, 4)
    reference.load_state_dict(base.state_dict())
    return reference, LoRALinear(base, rank, alpha, generator=torch.Generator().manual_seed(1))


def test_b_is_zero_at_init_so_the_output_is_the_base_output():
    reference, lora = _layer()
    x = torch.randn(2, 7, 5)
    assert torch.count_nonzero(lora.lora_B) == 0 and torch.count_nonzero(lora.lora_A) > 0
    assert torch.equal(lora(x), reference(x))


def test_forward_equals_base_plus_scaled_b_a_x():
    reference, lora = _layer(rank=3, alpha=6.0)
    with torch.no_grad():
        lora.lora_B.normal_()
    x = torch.randn(2, 7, 5)
    a, b = lora.lora_A.detach(), lora.lora_B.detach()
    expected = x @ reference.weight.T + reference.bias + 2.0 * torch.einsum("or,ri,bti->bto", b, a, x)
    assert torch.allclose(lora(x), expected, atol=1e-6)


def test_merged_weight_is_w_plus_scale_b_a():
    reference, lora = _layer(rank=3, alpha=6.0)
    with torch.no_grad():
        lora.lora_B.normal_()
    merged = merge(lora.base.weight, lora.lora_A, lora.lora_B, lora.scale)
    assert torch.allclose(merged, reference.weight + 2.0 * lora.lora_B @ lora.lora_A, atol=1e-6)
    x = torch.randn(3, 5)
    assert torch.allclose(lora(x), nn.functional.linear(x, merged, reference.bias), atol=1e-5)


def test_a_is_kaiming_uniform_like_peft():
    _, lora = _layer(rank=4)
    bound = 1 / 5**0.5  # kaiming_uniform(a=sqrt(5)): gain sqrt(1/3), bound gain * sqrt(3 / fan_in)
    largest = float(lora.lora_A.detach().abs().max())
    assert bound / 2 < largest <= bound


def test_apply_lora_wraps_targets_freezes_the_rest_and_keeps_the_output():
    model = build_tiny_model(seed=0).eval()
    ids = torch.randint(3, 250, (2, 9))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    wrapped = apply_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8.0, layers=decoder_layers(model))
    assert wrapped == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"{m}.{ab}" for m in wrapped for ab in ("lora_A", "lora_B")]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_all_linear_takes_every_decoder_linear_but_not_the_lm_head():
    model = build_tiny_model(seed=0, tie_word_embeddings=False)
    wrapped = apply_lora(model, ["all-linear"], rank=2, alpha=2.0, layers=decoder_layers(model))
    assert len(wrapped) == 2 * 7 and not any("lm_head" in name for name in wrapped)


def test_a_target_that_matches_nothing_names_the_key_and_the_choices():
    model = build_tiny_model(seed=0)
    with pytest.raises(ConfigError) as err:
        apply_lora(
            model,
            ["q_proj", "query"],
            2,
            2.0,
            layers=decoder_layers(model),
            path="actor_train.model_args.lora_target",
        )
    text = str(err.value)
    assert text.startswith("actor_train.model_args.lora_target: 'query' matches no linear module")
    assert "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj or all-linear" in text


def test_merged_state_has_the_original_names_and_merged_weights():
    model = build_tiny_model(seed=0)
    original = {n: t.clone() for n, t in model.state_dict().items()}
    apply_lora(model, ["q_proj", "down_proj"], rank=4, alpha=4.0, layers=decoder_layers(model), seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    merged = merged_state_dict(model)
    assert list(merged) == list(original)
    for name, tensor in merged.items():
        module = name.rpartition(".")[0]
        if name.endswith(("q_proj.weight", "down_proj.weight")):
            lora = model.get_submodule(module)
            assert torch.allclose(tensor, original[name] + lora.lora_B @ lora.lora_A, atol=1e-5), name
        else:
            assert torch.equal(tensor, original[name]), name
    adapters = adapter_state_dict(model)
    assert sorted(adapters) == sorted(
        f"model.layers.{i}.{m}.{ab}"
        for i in range(2)
        for m in ("self_attn.q_proj", "mlp.down_proj")
        for ab in ("lora_A", "lora_B")
    )


def test_merged_stream_waits_for_adapters_that_come_after_the_weight():
    w, a, b = torch.ones(2, 3), torch.ones(1, 3), torch.full((2, 1), 2.0)
    named = [("m.p.base.weight", w), ("m.p.base.bias", torch.zeros(2)), ("m.p.lora_B", b), ("m.p.lora_A", a)]
    out = dict(merged_stream(named, {"m.p": 0.5}))
    assert list(out) == ["m.p.bias", "m.p.weight"] and torch.equal(out["m.p.weight"], torch.full((2, 3), 2.0))
    with pytest.raises(ValueError, match="incomplete LoRA modules"):
        list(merged_stream(named[:2], {"m.p": 0.5}))


def test_hf_name_strips_only_a_wrapper_base():
    assert hf_name("a.q_proj.base.weight", {"a.q_proj"}) == "a.q_proj.weight"
    assert hf_name("a.base.weight", {"a.q_proj"}) == "a.base.weight"
