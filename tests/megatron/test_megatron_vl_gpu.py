"""Qwen2.5-VL on megatron_infer on one CUDA device, against transformers on the same device.

The tiny Qwen2.5-VL (tests/tiny_vl.py) scores image rows and a text row: fp32 (TF32 off) max
|diff| < 1e-4, and bf16 mean |diff| < 2e-2 over the response tokens (the bound the text models'
GPU test uses). The CPU variant (tests/megatron/test_megatron_vl_cpu.py) checks TP / PP / SP and
training on gloo; this one runs the CUDA kernels (SDPA, the vision tower's attention) in bf16.

    pytest -m gpu tests/megatron/test_megatron_vl_gpu.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

from gloo_ranks import process_group, spawn_ranks  # noqa: E402
from vl_cases import hf_log_probs, save_tiny_vl, vl_batch  # noqa: E402

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs  # noqa: E402
from roll.core.worker_context import WorkerContext  # noqa: E402

FP32_MAX_DIFF = 1e-4
BF16_MEAN_DIFF = 2e-2


def _megatron_log_probs(path: str, dtype: str) -> torch.Tensor:
    from roll.distributed.strategy.registry import load_strategy_class

    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=path, dtype=dtype),
        strategy_args=StrategyArgs("megatron_infer", {}),
        infer_batch_size=2,
    )
    ctx = WorkerContext("reference", 0, 1, 0, torch.device("cuda", 0), seed=7)
    strategy = load_strategy_class("megatron_infer")(role, ctx)
    strategy.initialize()
    return strategy.compute_log_probs(torch.load(Path(path).parent / "batch.pt", weights_only=False))[
        "log_probs"
    ]


def _worker(rank: int, world_size: int, port: int, path: str) -> None:
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with process_group(rank, world_size, port, backend="nccl"):
        for dtype in ("fp32", "bf16"):
            got = _megatron_log_probs(path, dtype)
            torch.save(got, Path(path).parent / f"megatron_{dtype}.pt")
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        dist.barrier()


@pytest.mark.gpu
def test_megatron_vl_log_probs_match_transformers_on_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = save_tiny_vl(tmp_path / "model")
    batch = vl_batch(model, tmp_path)
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(_worker, 1, str(model))
    mask = batch["response_mask"].bool()
    bad = []
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        want = hf_log_probs(model, batch, torch_dtype, "cuda")
        got = torch.load(tmp_path / f"megatron_{dtype}.pt")
        diff = (got - want).abs()[mask]
        print(f"{dtype}: max |diff| {float(diff.max()):.3e}, mean {float(diff.mean()):.3e}")
        if dtype == "fp32" and float(diff.max()) > FP32_MAX_DIFF:
            bad.append(f"fp32 max |diff| {float(diff.max()):.3e} > {FP32_MAX_DIFF}")
        if dtype == "bf16" and float(diff.mean()) > BF16_MEAN_DIFF:
            bad.append(f"bf16 mean |diff| {float(diff.mean()):.3e} > {BF16_MEAN_DIFF}")
    assert not bad, "\n".join(bad)
