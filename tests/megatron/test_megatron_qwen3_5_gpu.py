"""Qwen3.5 and Qwen3.5-MoE on megatron_infer on one CUDA device, against transformers on the same
device (tests/tiny_qwen3_5.py's models, image rows and a text row): fp32 (TF32 off) max |diff| <
1e-4 and bf16 mean |diff| < 2e-2 over the response tokens, the bounds of the Qwen2.5-VL GPU test
(tests/megatron/test_megatron_vl_gpu.py; both run tests/megatron/vl_gpu_checks.py). The Gated DeltaNet layers run
fla's Triton kernel where flash-linear-attention is installed (roll.models.megatron.gated_delta_rule).

On two devices (NCCL, marked ``multigpu``): the dense model's log-probs at context parallelism 2
(megatron_train, and a megatron_infer reference; the Gated DeltaNet layers head-parallel,
roll.models.megatron.gdn_context_parallel) against CP 1 (padded and packed rows, DP 2) and
transformers, fp32 and bf16 with the bounds above, and a bf16 train step at CP 2 whose gradient norm
is CP 1's within 5% and whose gradients reach the Gated DeltaNet layers and the vision tower.

    pytest -m gpu tests/megatron/test_megatron_qwen3_5_gpu.py
    pytest -m "gpu and multigpu" tests/megatron/test_megatron_qwen3_5_gpu.py -k two_devices
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
from tiny_qwen3_5 import build_tiny_qwen3_5_dir  # noqa: E402
from two_rank_training import pg_loss  # noqa: E402
from vl_cases import vl_batch  # noqa: E402
from vl_gpu_checks import (  # noqa: E402
    BF16_MEAN_DIFF,
    FP32_MAX_DIFF,
    log_prob_mismatches,
    one_device_mismatches,
    strategy,
    tf32_off,
    train_step_mismatches,
    two_device_worker,
)

from roll.models.megatron.hf_io import unwrap  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_megatron_qwen3_5_log_probs_match_transformers_on_cuda(tmp_path: Path, moe: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tf32_off()
    model = build_tiny_qwen3_5_dir(tmp_path / "model", moe=moe, mtp=True)
    bad = one_device_mismatches(model, vl_batch(model, tmp_path), tmp_path)
    assert not bad, "\n".join(bad)


# name -> (strategy, strategy_config) of the two-device cases
TWO_DEVICE_CASES = {
    "padded": ("megatron_train", {"sequence_packing": False}),
    "packed": ("megatron_train", {"sequence_packing": True}),
    "cp2": ("megatron_train", {"context_parallel_size": 2}),
    "infer cp2": ("megatron_infer", {"context_parallel_size": 2}),
}


def _grad_sums(built) -> dict[str, float]:
    grads = {n: p.main_grad for n, p in unwrap(built.model[0]).named_parameters() if p.main_grad is not None}
    return {
        "tower_grad": float(sum(g.float().abs().sum() for n, g in grads.items() if n.startswith("visual."))),
        "gdn_grad": float(sum(g.float().abs().sum() for n, g in grads.items() if "in_proj" in n)),
    }


def _train_steps(path: str, rank: int, world_size: int) -> dict:
    """bf16 train steps on the batch at CP 1 (DP 2, padded rows) and at CP 2: CP 2's metrics and
    gradient sums, with CP 1's gradient norm."""
    from megatron.core import parallel_state as ps

    batch = torch.load(Path(path).parent / "batch.pt", weights_only=False)
    one = strategy(path, "bf16", "megatron_train", {"sequence_packing": False}, rank, world_size)
    cp1_norm = one.train_step(batch.split(2), pg_loss)["grad_norm"]
    del one
    ps.destroy_model_parallel()
    built = strategy(path, "bf16", "megatron_train", {"context_parallel_size": 2}, rank, world_size)
    metrics = built.train_step(batch.split(2), pg_loss)
    return {**metrics, **_grad_sums(built), "cp1_grad_norm": cp1_norm}


def _cp_mismatches(scratch: Path, mask: torch.Tensor) -> list[str]:
    """CP 2's log-probs against CP 1's on padded rows: fp32 max |diff|, bf16 mean |diff|."""
    bad = []
    for dtype in ("fp32", "bf16"):
        base = torch.load(scratch / f"two_padded_{dtype}.pt")
        for case in ("cp2", "infer cp2"):
            diff = (torch.load(scratch / f"two_{case}_{dtype}.pt") - base).abs()[mask]
            print(
                f"{case} vs CP 1 {dtype}: max |diff| {float(diff.max()):.3e}, mean {float(diff.mean()):.3e}"
            )
            if dtype == "fp32" and float(diff.max()) > FP32_MAX_DIFF:
                bad.append(f"{case} vs CP 1 fp32 max |diff| {float(diff.max()):.3e} > {FP32_MAX_DIFF}")
            if dtype == "bf16" and float(diff.mean()) > BF16_MEAN_DIFF:
                bad.append(f"{case} vs CP 1 bf16 mean |diff| {float(diff.mean()):.3e} > {BF16_MEAN_DIFF}")
    return bad


@pytest.mark.gpu
@pytest.mark.multigpu
def test_megatron_qwen3_5_cp2_matches_cp1_on_two_devices(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    tf32_off()
    model = build_tiny_qwen3_5_dir(tmp_path / "model", moe=False)
    batch = vl_batch(model, tmp_path)
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(two_device_worker, 2, str(model), "batch.pt", TWO_DEVICE_CASES, _train_steps)
    files = {case: f"two_{case}_{{dtype}}.pt" for case in TWO_DEVICE_CASES}
    bad = log_prob_mismatches(model, batch, tmp_path, files)
    bad += _cp_mismatches(tmp_path, batch["response_mask"].bool())
    metrics = torch.load(tmp_path / "two_train_cp2.pt")
    bad += train_step_mismatches(metrics, ("tower_grad", "gdn_grad"))
    if abs(metrics["grad_norm"] - metrics["cp1_grad_norm"]) > 0.05 * metrics["cp1_grad_norm"]:
        bad.append(f"CP 2 gradient norm {metrics['grad_norm']:.4g} vs CP 1's {metrics['cp1_grad_norm']:.4g}")
    assert not bad, "\n".join(bad)
