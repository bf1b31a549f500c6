"""``routing_steady`` (tests/engine_vl_gpu.py, the SGLang Qwen3-VL-MoE GPU checks) on CPU with the
tiny Qwen3-VL-MoE: it leaves the routers as they were, keeps every token when the change is 0,
and leaves out more tokens the larger the change."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import engine_vl_gpu  # noqa: E402
from engine_vl_gpu import hf_sampled_logprobs, routing_steady  # noqa: E402
from tiny_qwen3_vl import build_tiny_qwen3_vl_dir  # noqa: E402

from roll.core.batch import Batch  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402


def test_routing_steady_marks_tokens_by_how_far_a_router_change_moves_them(tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText

    model_dir = build_tiny_qwen3_vl_dir(tmp_path / "moe", std=0.1, moe=True)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, 200, (4, 12), generator=gen)
    batch = Batch.from_dict({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)})
    out = build_generation_batch(
        batch, torch.randint(5, 200, (4, 16), generator=gen).tolist(), None, 1, 0, 16
    )
    want = hf_sampled_logprobs(model, out)
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert len(routers) == 4  # every decoder layer of the tiny MoE

    counts, one_step = {}, engine_vl_gpu.BF16_STEP
    for step in (0.0, one_step, 0.5):
        monkeypatch.setattr(engine_vl_gpu, "BF16_STEP", step)
        steady = routing_steady(model, out, want)
        assert steady.shape == want.shape and steady.dtype == torch.bool
        counts[step] = int(steady.sum())
        for name, param in model.named_parameters():
            if name in routers:
                assert torch.equal(param, routers[name])
    assert counts[0.0] == want.numel()
    assert counts[0.5] < counts[one_step] <= counts[0.0]
    print(f"steady tokens of {want.numel()}: {counts}")
