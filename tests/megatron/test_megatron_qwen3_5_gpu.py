"""Qwen3.5 and Qwen3.5-MoE on megatron_infer on one CUDA device, against transformers on the same
device (tests/tiny_qwen3_5.py's models, image rows and a text row): fp32 (TF32 off) max |diff| <
1e-4 and bf16 mean |diff| < 2e-2 over the response tokens, the bounds of the Qwen2.5-VL GPU test
(tests/megatron/test_megatron_vl_gpu.py; both run tests/megatron/vl_gpu_checks.py). The Gated DeltaNet layers run
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

from tiny_qwen3_5 import build_tiny_qwen3_5_dir  # noqa: E402
from vl_cases import vl_batch  # noqa: E402
from vl_gpu_checks import one_device_mismatches, tf32_off  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_megatron_qwen3_5_log_probs_match_transformers_on_cuda(tmp_path: Path, moe: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tf32_off()
    model = build_tiny_qwen3_5_dir(tmp_path / "model", moe=moe, mtp=True)
    bad = one_device_mismatches(model, vl_batch(model, tmp_path), tmp_path)
    assert not bad, "\n".join(bad)
