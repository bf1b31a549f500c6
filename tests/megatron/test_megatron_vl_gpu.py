"""Qwen2.5-VL on megatron_infer on one CUDA device, against transformers on the same device.

The tiny Qwen2.5-VL (tests/tiny_vl.py) scores image rows and a text row: fp32 (TF32 off) max
|diff| < 1e-4, and bf16 mean |diff| < 2e-2 over the response tokens (the bound the text models'
GPU test uses). The CPU variant (tests/megatron/test_megatron_vl_cpu.py) checks TP / PP / SP and
training on gloo; this one runs the CUDA kernels (SDPA, the vision tower's attention) in bf16.

On two devices (NCCL, marked ``multigpu``), a batch of video rows, image rows and a text row
(``vl_cases.vl_video_batch``) scored on padded rows, packed rows (DP 2) and context parallelism 2
(megatron_train and a megatron_infer reference), with the same bounds, and one bf16 train step at
CP 2 (finite loss, a gradient reaching the vision tower).

    pytest -m gpu tests/megatron/test_megatron_vl_gpu.py
    pytest -m "gpu and multigpu" tests/megatron/test_megatron_vl_gpu.py -k two_devices
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
from two_rank_training import pg_loss  # noqa: E402
from vl_cases import hf_log_probs, save_tiny_vl, vl_batch, vl_video_batch  # noqa: E402

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs  # noqa: E402
from roll.core.worker_context import WorkerContext  # noqa: E402
from roll.models.megatron.hf_io import unwrap  # noqa: E402

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


# name -> (strategy, strategy_config) of the two-device cases
TWO_DEVICE_CASES = {
    "padded": ("megatron_train", {"sequence_packing": False}),
    "packed": ("megatron_train", {"sequence_packing": True}),
    "cp2": ("megatron_train", {"context_parallel_size": 2}),
    "cp2 budget": ("megatron_train", {"context_parallel_size": 2, "infer_max_tokens_per_microbatch": 1400}),
    "infer cp2": ("megatron_infer", {"context_parallel_size": 2}),
}


def _strategy(path: str, dtype: str, name: str, layout: dict, rank: int, world_size: int):
    from roll.distributed.strategy.registry import load_strategy_class

    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=path, dtype=dtype),
        training_args=TrainingArgs(learning_rate=1e-5, max_grad_norm=1.0),
        strategy_args=StrategyArgs(name, dict(layout)),
        infer_batch_size=2,
    )
    ctx = WorkerContext("actor", rank, world_size, rank, torch.device("cuda", rank), seed=7)
    strategy = load_strategy_class(name)(role, ctx)
    strategy.initialize()
    return strategy


def _train_step_cp2(path: str, rank: int, world_size: int) -> dict:
    strategy = _strategy(path, "bf16", "megatron_train", {"context_parallel_size": 2}, rank, world_size)
    batch = torch.load(Path(path).parent / "video_batch.pt", weights_only=False)
    metrics = strategy.train_step(batch.split(3), pg_loss)
    tower = [p.main_grad for n, p in unwrap(strategy.model[0]).named_parameters() if n.startswith("visual.")]
    return {**metrics, "tower_grad": float(sum(g.float().abs().sum() for g in tower if g is not None))}


def _two_device_worker(rank: int, world_size: int, port: int, path: str) -> None:
    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    batch = torch.load(Path(path).parent / "video_batch.pt", weights_only=False)
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
def test_megatron_vl_videos_packed_and_cp2_match_transformers_on_two_devices(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    pytest.importorskip("av")  # PyAV decodes the videos
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = save_tiny_vl(tmp_path / "model")
    batch = vl_video_batch(model, tmp_path)
    torch.save(batch, tmp_path / "video_batch.pt")
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
    ):
        bad.append(f"train step at CP 2: {metrics}")
    assert not bad, "\n".join(bad)
