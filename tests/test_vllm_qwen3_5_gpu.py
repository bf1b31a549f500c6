"""The model update's names of Qwen3.5-MoE reach vLLM's loader (CUDA, vLLM), as
tests/test_vllm_model_names_gpu.py checks them for Qwen3-MoE and Qwen3-Next.

What megatron_train exports for Qwen3.5 (and fsdp2_train sends) is the checkpoint's tensors under
its names (tests/megatron/test_megatron_qwen3_5_cpu.py, tests/test_fsdp2_qwen3_5_cpu.py):
``model.language_model.*`` with the Gated DeltaNet's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a``, one tensor per expert and projection, ``model.visual.*``, ``lm_head.weight``, no
``mtp.*``. vLLM starts on tiny model A (``load_format`` auto, ``sleep_level`` 0), loads model B's
tensors under those names, and must then score B's sampled tokens as transformers does (before the
load it must not). Bounds: test_vllm_model_names_gpu's routed ones. Text prompts: the vision
tower's names are sent but not scored here.

    pytest -m gpu tests/test_vllm_qwen3_5_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).parent))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from engine_gpu import hf_logprobs, make_strategy, prompt_batch  # noqa: E402
from test_vllm_model_names_gpu import assert_close_routed  # noqa: E402
from tiny_qwen3_5 import build_tiny_qwen3_5_dir  # noqa: E402

from roll.core.sampling import SamplingParams  # noqa: E402


def test_qwen3_5_moe_update_names_load_into_vllm(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    a = build_tiny_qwen3_5_dir(
        tmp_path / "a", moe=True, seed=0, full_processor=True, linear_head_dims=(16, 16)
    )
    b = build_tiny_qwen3_5_dir(
        tmp_path / "b", moe=True, seed=1, full_processor=True, mtp=True, linear_head_dims=(16, 16)
    )
    engine = make_strategy("vllm", a, gpu_memory_utilization=0.25, enforce_eager=True, sleep_level=0)
    try:
        out = engine.generate(
            prompt_batch(a, ["What color is red?", "How many boxes are there?"]),
            SamplingParams(n=2, max_new_tokens=8, seed=4),
        )
        new = AutoModelForImageTextToText.from_pretrained(b, dtype=torch.bfloat16).cuda().eval()
        want, mask = hf_logprobs(new, out), out["response_mask"]
        with pytest.raises(AssertionError):  # model A's weights do not score like B
            assert_close_routed(engine.compute_log_probs(out)["log_probs"], want, mask, "before")
        sent = [(n, t) for n, t in load_file(b / "model.safetensors").items() if not n.startswith("mtp.")]
        assert any(".linear_attn.in_proj_qkv.weight" in n for n, _ in sent)
        engine.load_weights(iter(sent))
        assert_close_routed(engine.compute_log_probs(out)["log_probs"], want, mask, "after the load")
    finally:
        del engine.llm
        torch.cuda.empty_cache()
