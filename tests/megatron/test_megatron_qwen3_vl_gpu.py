"""Qwen3-VL on megatron_infer on one CUDA device, against transformers on the same device.

The tiny Qwen3-VL (tests/tiny_qwen3_vl.py: deepstack, interleaved mrope) scores image rows and a
text row with the bounds of the Qwen2.5-VL GPU test (fp32 max |diff| < 1e-4 with TF32 off, bf16 mean
|diff| < 2e-2); the CPU variant (test_megatron_qwen3_vl_cpu.py) checks TP / PP / SP and training.

    pytest -m gpu tests/megatron/test_megatron_qwen3_vl_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

pytest.importorskip("megatron.core")

from gloo_ranks import spawn_ranks  # noqa: E402
from test_megatron_vl_gpu import BF16_MEAN_DIFF, FP32_MAX_DIFF, _worker  # noqa: E402
from tiny_qwen3_vl import build_tiny_qwen3_vl_dir, released_layout  # noqa: E402
from vl_cases import hf_log_probs, vl_batch  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_megatron_qwen3_vl_log_probs_match_transformers_on_cuda(tmp_path: Path, moe: bool) -> None:
    """``moe``: Qwen3-VL-MoE (4 experts, top 2) from the released layout (stacked, transposed)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build_tiny_qwen3_vl_dir(tmp_path / "model", std=0.1, moe=moe)
    if moe:
        released_layout(model)
    batch = vl_batch(model, tmp_path)
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(_worker, 1, str(model))
    mask = batch["response_mask"].bool()
    bad = []
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        want = hf_log_probs(model, batch, torch_dtype, "cuda")
        diff = (torch.load(tmp_path / f"megatron_{dtype}.pt") - want).abs()[mask]
        print(f"{dtype}: max |diff| {float(diff.max()):.3e}, mean {float(diff.mean()):.3e}")
        if dtype == "fp32" and float(diff.max()) > FP32_MAX_DIFF:
            bad.append(f"fp32 max |diff| {float(diff.max()):.3e} > {FP32_MAX_DIFF}")
        if dtype == "bf16" and float(diff.mean()) > BF16_MEAN_DIFF:
            bad.append(f"bf16 mean |diff| {float(diff.mean()):.3e} > {BF16_MEAN_DIFF}")
    assert not bad, "\n".join(bad)
