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
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

from gloo_ranks import spawn_ranks  # noqa: E402
from tiny_qwen3_vl import build_tiny_qwen3_vl_dir, released_layout  # noqa: E402
from two_rank_training import pg_loss  # noqa: E402
from vl_cases import vl_batch  # noqa: E402
from vl_gpu_checks import (  # noqa: E402
    log_prob_mismatches,
    one_device_mismatches,
    strategy,
    tf32_off,
    train_step_mismatches,
    two_device_worker,
)


def _model(tmp_path: Path, moe: bool) -> Path:
    model = build_tiny_qwen3_vl_dir(tmp_path / "model", std=0.1, moe=moe)
    if moe:
        released_layout(model)
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_megatron_qwen3_vl_log_probs_match_transformers_on_cuda(tmp_path: Path, moe: bool) -> None:
    """``moe``: Qwen3-VL-MoE (4 experts, top 2) from the released layout (stacked, transposed)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tf32_off()
    model = _model(tmp_path, moe)
    bad = one_device_mismatches(model, vl_batch(model, tmp_path), tmp_path)
    assert not bad, "\n".join(bad)


# name -> (strategy, strategy_config) of the two-device cases
TWO_DEVICE_CASES = {
    "packed": ("megatron_train", {"sequence_packing": True}),
    "cp2": ("megatron_train", {"context_parallel_size": 2}),
    "infer cp2": ("megatron_infer", {"context_parallel_size": 2}),
}


def _train_step_cp2(path: str, rank: int, world_size: int) -> dict:
    from roll.models.megatron.hf_io import unwrap

    built = strategy(path, "bf16", "megatron_train", {"context_parallel_size": 2}, rank, world_size)
    batch = torch.load(Path(path).parent / "batch.pt", weights_only=False)
    metrics = built.train_step(batch.split(2), pg_loss)
    grads = {n: p.main_grad for n, p in unwrap(built.model[0]).named_parameters() if n.startswith("visual.")}
    deepstack = [g for n, g in grads.items() if n.startswith("visual.deepstack_merger_list.")]
    total = lambda gs: float(sum(g.float().abs().sum() for g in gs if g is not None))  # noqa: E731
    return {**metrics, "tower_grad": total(grads.values()), "deepstack_grad": total(deepstack)}


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_megatron_qwen3_vl_packed_and_cp2_match_transformers_on_two_devices(
    tmp_path: Path, moe: bool
) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    tf32_off()
    model = _model(tmp_path, moe)
    batch = vl_batch(model, tmp_path)
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(two_device_worker, 2, str(model), "batch.pt", TWO_DEVICE_CASES, _train_step_cp2)
    files = {case: f"two_{case}_{{dtype}}.pt" for case in TWO_DEVICE_CASES}
    bad = log_prob_mismatches(model, batch, tmp_path, files)
    metrics = torch.load(tmp_path / "two_train_cp2.pt")
    bad += train_step_mismatches(metrics, ("tower_grad", "deepstack_grad"))
    assert not bad, "\n".join(bad)
