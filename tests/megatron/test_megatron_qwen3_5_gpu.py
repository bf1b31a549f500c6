"""Qwen3.5 and Qwen3.5-MoE on megatron_infer on one CUDA device, against transformers on the same
device (tests/tiny_qwen3_5.py's models, image rows and a text row): fp32 (TF32 off) max |diff| <
1e-4 and bf16 mean |diff| < 2e-2 over the response tokens, the bounds of the Qwen2.5-VL GPU test
(tests/megatron/test_megatron_vl_gpu.py, whose worker this reuses). The Gated DeltaNet layers run
fla's Triton kernel where flash-linear-attention is installed (roll.models.megatron.gated_delta_rule).

    pytest -m gpu tests/megatron/test_megatron_qwen3_5_gpu.py
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
from tiny_qwen3_5 import build_tiny_qwen3_5_dir  # noqa: E402
from vl_cases import hf_log_probs, vl_batch  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_megatron_qwen3_5_log_probs_match_transformers_on_cuda(tmp_path: Path, moe: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build_tiny_qwen3_5_dir(tmp_path / "model", moe=moe, mtp=True)
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
