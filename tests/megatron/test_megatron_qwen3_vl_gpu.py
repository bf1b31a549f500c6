"""Qwen3-VL on megatron_infer on one CUDA device, against transformers on the same device.

The tiny Qwen3-VL (tests/tiny_qwen3_vl.py: deepstack, interleaved mrope) scores image rows and a
text row with the bounds of the Qwen2.5-VL GPU test (fp32 max |diff| < 1e-4 with TF32 off, bf16 mean
|diff| < 2e-2); the CPU variant (test_megatron_qwen3_vl_cpu.py) checks TP / PP / SP and training.

On two devices (NCCL, marked ``multigpu``), the same rows on packed rows (DP 2) and at context
parallelism 2 (megatron_train and a megatron_infer reference: each CP rank's share of the packed row,
its image and deepstack features), with the same bounds, and one bf16 train step at CP 2 (finite
loss, gradients reaching the tower's deepstack mergers).

    pytest -m gpu tests/megatron/test_megatron_qwen3_vl_gpu.py
    pytest -m "gpu and multigpu" tests/megatron/test_megatron_qwen3_vl_gpu.py -k two_devices
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
from test_megatron_vl_gpu import BF16_MEAN_DIFF, FP32_MAX_DIFF, _strategy, _worker  # noqa: E402
from tiny_qwen3_vl import build_tiny_qwen3_vl_dir, released_layout  # noqa: E402
from two_rank_training import pg_loss  # noqa: E402
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


# name -> (strategy, strategy_config) of the two-device cases
TWO_DEVICE_CASES = {
    "packed": ("megatron_train", {"sequence_packing": True}),
    "cp2": ("megatron_train", {"context_parallel_size": 2}),
    "infer cp2": ("megatron_infer", {"context_parallel_size": 2}),
}


def _train_step_cp2(path: str, rank: int, world_size: int) -> dict:
    from roll.models.megatron.hf_io import unwrap

    strategy = _strategy(path, "bf16", "megatron_train", {"context_parallel_size": 2}, rank, world_size)
    batch = torch.load(Path(path).parent / "batch.pt", weights_only=False)
    metrics = strategy.train_step(batch.split(2), pg_loss)
    grads = {
        n: p.main_grad for n, p in unwrap(strategy.model[0]).named_parameters() if n.startswith("visual.")
    }
    deepstack = [g for n, g in grads.items() if n.startswith("visual.deepstack_merger_list.")]
    total = lambda gs: float(sum(g.float().abs().sum() for g in gs if g is not None))  # noqa: E731
    return {**metrics, "tower_grad": total(grads.values()), "deepstack_grad": total(deepstack)}


def _two_device_worker(rank: int, world_size: int, port: int, path: str) -> None:
    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    batch = torch.load(Path(path).parent / "batch.pt", weights_only=False)
    with process_group(rank, world_size, port, backend="nccl"):
        for dtype in ("fp32", "bf16"):
            for case, (name, layout) in TWO_DEVICE_CASES.items():
                got = _strategy(path, dtype, name, layout, rank, world_size).compute_log_probs(batch)
                if rank == 0:
                    torch.save(got["log_probs"], Path(path).parent / f"two_{case}_{dtype}.pt")
                ps.destroy_model_parallel()
                dist.barrier()
        metrics = _train_step_cp2(path, rank, world_size)
        if rank == 0:
            torch.save(metrics, Path(path).parent / "two_train_cp2.pt")
        dist.barrier()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_megatron_qwen3_vl_packed_and_cp2_match_transformers_on_two_devices(
    tmp_path: Path, moe: bool
) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build_tiny_qwen3_vl_dir(tmp_path / "model", std=0.1, moe=moe)
    if moe:
        released_layout(model)
    batch = vl_batch(model, tmp_path)
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(_two_device_worker, 2, str(model))
    mask = batch["response_mask"].bool()
    bad = []
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        want = hf_log_probs(model, batch, torch_dtype, "cuda")
        for case in TWO_DEVICE_CASES:
            diff = (torch.load(tmp_path / f"two_{case}_{dtype}.pt") - want).abs()[mask]
            print(f"{case} {dtype}: max |diff| {float(diff.max()):.3e}, mean {float(diff.mean()):.3e}")
            if dtype == "fp32" and float(diff.max()) > FP32_MAX_DIFF:
                bad.append(f"{case} fp32 max |diff| {float(diff.max()):.3e} > {FP32_MAX_DIFF}")
            if dtype == "bf16" and float(diff.mean()) > BF16_MEAN_DIFF:
                bad.append(f"{case} bf16 mean |diff| {float(diff.mean()):.3e} > {BF16_MEAN_DIFF}")
    metrics = torch.load(tmp_path / "two_train_cp2.pt")
    print(f"train step at CP 2 (bf16): {metrics}")
    if not (
        torch.isfinite(torch.tensor(metrics["loss"]))
        and metrics["grad_norm"] > 0
        and metrics["tower_grad"] > 0
        and metrics["deepstack_grad"] > 0
    ):
        bad.append(f"train step at CP 2: {metrics}")
    assert not bad, "\n".join(bad)
