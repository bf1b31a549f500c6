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
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

from gloo_ranks import spawn_ranks  # noqa: E402
from two_rank_training import pg_loss  # noqa: E402
from vl_cases import save_tiny_vl, vl_batch, vl_video_batch  # noqa: E402
from vl_gpu_checks import (  # noqa: E402
    log_prob_mismatches,
    one_device_mismatches,
    strategy,
    tf32_off,
    train_step_mismatches,
    two_device_worker,
)

from roll.models.megatron.hf_io import unwrap  # noqa: E402


@pytest.mark.gpu
def test_megatron_vl_log_probs_match_transformers_on_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tf32_off()
    model = save_tiny_vl(tmp_path / "model")
    bad = one_device_mismatches(model, vl_batch(model, tmp_path), tmp_path)
    assert not bad, "\n".join(bad)


# name -> (strategy, strategy_config) of the two-device cases
TWO_DEVICE_CASES = {
    "padded": ("megatron_train", {"sequence_packing": False}),
    "packed": ("megatron_train", {"sequence_packing": True}),
    "cp2": ("megatron_train", {"context_parallel_size": 2}),
    "cp2 budget": ("megatron_train", {"context_parallel_size": 2, "infer_max_tokens_per_microbatch": 1400}),
    "infer cp2": ("megatron_infer", {"context_parallel_size": 2}),
}


def _train_step_cp2(path: str, rank: int, world_size: int) -> dict:
    built = strategy(path, "bf16", "megatron_train", {"context_parallel_size": 2}, rank, world_size)
    batch = torch.load(Path(path).parent / "video_batch.pt", weights_only=False)
    metrics = built.train_step(batch.split(3), pg_loss)
    tower = [p.main_grad for n, p in unwrap(built.model[0]).named_parameters() if n.startswith("visual.")]
    return {**metrics, "tower_grad": float(sum(g.float().abs().sum() for g in tower if g is not None))}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_megatron_vl_videos_packed_and_cp2_match_transformers_on_two_devices(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    pytest.importorskip("av")  # PyAV decodes the videos
    tf32_off()
    model = save_tiny_vl(tmp_path / "model")
    batch = vl_video_batch(model, tmp_path)
    torch.save(batch, tmp_path / "video_batch.pt")
    spawn_ranks(two_device_worker, 2, str(model), "video_batch.pt", TWO_DEVICE_CASES, _train_step_cp2)
    files = {case: f"two_{case}_{{dtype}}.pt" for case in TWO_DEVICE_CASES}
    bad = log_prob_mismatches(model, batch, tmp_path, files)
    bad += train_step_mismatches(torch.load(tmp_path / "two_train_cp2.pt"), ("tower_grad",))
    assert not bad, "\n".join(bad)
