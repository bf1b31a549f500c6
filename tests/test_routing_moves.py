"""``routing_moves`` and ``assert_close_moe`` (tests/engine_vl_gpu.py, the SGLang Qwen3-VL-MoE GPU
checks) on CPU with the tiny Qwen3-VL-MoE in bf16: the moves are 0 for no change and grow with it,
the routers come back as they were, and against the bf16 model the same weights in fp32 (another
implementation's rounding) pass while a layer with two experts swapped fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import engine_vl_gpu  # noqa: E402
from engine_vl_gpu import assert_close_moe, hf_sampled_logprobs, routing_moves  # noqa: E402
from tiny_qwen3_vl import build_tiny_qwen3_vl_dir  # noqa: E402

from roll.core.batch import Batch  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(the tiny Qwen3-VL-MoE's directory, a batch of 8 random responses of 16 tokens)."""
    model_dir = build_tiny_qwen3_vl_dir(tmp_path_factory.mktemp("moe") / "moe", std=0.1, moe=True)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, 200, (8, 24), generator=gen)
    batch = Batch.from_dict({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)})
    responses = torch.randint(5, 200, (8, 16), generator=gen).tolist()
    return model_dir, build_generation_batch(batch, responses, None, 1, 0, 16)


def load(model_dir, dtype):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()


def test_routing_moves_grow_with_the_change_and_leave_the_routers(moe, monkeypatch):
    model_dir, out = moe
    model = load(model_dir, torch.bfloat16)
    want = hf_sampled_logprobs(model, out)
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert len(routers) == 4  # every decoder layer of the tiny MoE
    means, one_step = {}, engine_vl_gpu.BF16_STEP
    for step in (0.0, one_step, 0.5):
        monkeypatch.setattr(engine_vl_gpu, "BF16_STEP", step)
        moves = routing_moves(model, out, want)
        assert moves.shape == want.shape
        means[step] = moves.mean().item()
        for name, param in model.named_parameters():
            if name in routers:
                assert torch.equal(param, routers[name])
    print(f"mean moves by step: {means}")
    assert means[0.0] == 0
    assert 0 < means[one_step] < means[0.5]


def test_assert_close_moe_passes_other_rounding_and_fails_swapped_experts(moe):
    model_dir, out = moe
    reference, other = load(model_dir, torch.bfloat16), load(model_dir, torch.float32)
    assert_close_moe(hf_sampled_logprobs(other, out), reference, out, "fp32 against bf16")
    experts = other.model.language_model.layers[1].mlp.experts
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(param[[1, 0, 2, 3]])
    with pytest.raises(AssertionError, match="beyond the routers' bf16 step"):
        assert_close_moe(hf_sampled_logprobs(other, out), reference, out, "experts 0 and 1 swapped")
