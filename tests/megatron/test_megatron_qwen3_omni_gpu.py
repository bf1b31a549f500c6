"""Qwen3-Omni-MoE's thinker on megatron on CUDA, against transformers' thinker on the same device.

The tiny Qwen3-Omni (tests/tiny_qwen3_omni.py, a ``thinker.*`` checkpoint as Qwen releases it) scores
``omni_cases.audio_batch`` (an audio row, an image row, an image + audio row and a text row through
roll's data path) with the bounds of the other vision-language GPU tests (fp32 max |diff| < 1e-4 with
TF32 off, bf16 mean |diff| < 2e-2); the CPU variant (test_megatron_qwen3_omni_cpu.py) checks the same
rows on gloo, the export and the gradients.

One device: megatron_infer. Two devices (NCCL, marked ``multigpu``): megatron_train at TP 2 + SP and
at EP 2 (padded rows), megatron_infer at CP 2 (packed rows, ROLL's audio_test_80G reference), then one
bf16 train step at CP 2 with the towers frozen as ROLL's qwen3-omni files freeze them (finite loss,
gradients in the language model, none in the towers).

    pytest -m gpu tests/megatron/test_megatron_qwen3_omni_gpu.py
    pytest -m "gpu and multigpu" tests/megatron/test_megatron_qwen3_omni_gpu.py -k two_devices
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
from omni_cases import audio_batch, thinker_log_probs  # noqa: E402
from tiny_qwen3_omni import build_tiny_qwen3_omni_dir  # noqa: E402
from two_rank_training import pg_loss  # noqa: E402
from vl_gpu_checks import (  # noqa: E402
    log_prob_mismatches,
    one_device_mismatches,
    strategy,
    tf32_off,
    train_step_mismatches,
    two_device_worker,
)

# name -> (strategy, strategy_config) of the two-device cases
TWO_DEVICE_CASES = {
    "tp2 sp": ("megatron_train", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "ep2": ("megatron_train", {"expert_model_parallel_size": 2}),
    "infer cp2": ("megatron_infer", {"context_parallel_size": 2}),
}
# what ROLL's qwen3-omni files freeze (the talker and code2wav are not built)
FROZEN = ["vision_model", "audio_model", "talker", "code2wav"]


@pytest.mark.gpu
def test_megatron_qwen3_omni_log_probs_match_transformers_on_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tf32_off()
    model = build_tiny_qwen3_omni_dir(tmp_path / "model")
    bad = one_device_mismatches(model, audio_batch(model, tmp_path), tmp_path, thinker_log_probs)
    assert not bad, "\n".join(bad)


def _train_step_cp2(path: str, rank: int, world_size: int) -> dict:
    from roll.models.megatron.hf_io import unwrap

    cp2 = {"context_parallel_size": 2}
    built = strategy(path, "bf16", "megatron_train", cp2, rank, world_size, freeze_module_prefix=FROZEN)
    batch = torch.load(Path(path).parent / "batch.pt", weights_only=False)
    batch.tensors["advantages"] = torch.linspace(-1.0, 1.0, batch["responses"].numel()).view_as(
        batch["responses"]
    )
    metrics = built.train_step(batch.split(2), pg_loss)
    params = dict(unwrap(built.model[0]).named_parameters())

    def total(prefix: str) -> float:
        return float(
            sum(
                p.main_grad.float().abs().sum()
                for n, p in params.items()
                if n.startswith(prefix) and p.requires_grad and p.main_grad is not None
            )
        )

    towers = [n for n, p in params.items() if n.startswith(("visual.", "audio_tower.")) and p.requires_grad]
    return {**metrics, "decoder_grad": total("decoder."), "trainable_tower_params": float(len(towers))}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_megatron_qwen3_omni_tp_ep_cp_match_transformers_on_two_devices(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    tf32_off()
    model = build_tiny_qwen3_omni_dir(tmp_path / "model")
    batch = audio_batch(model, tmp_path)
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(two_device_worker, 2, str(model), "batch.pt", TWO_DEVICE_CASES, _train_step_cp2)
    files = {case: f"two_{case}_{{dtype}}.pt" for case in TWO_DEVICE_CASES}
    bad = log_prob_mismatches(model, batch, tmp_path, files, thinker_log_probs)
    metrics = torch.load(tmp_path / "two_train_cp2.pt")
    bad += train_step_mismatches(metrics, ("decoder_grad",))
    if metrics["trainable_tower_params"]:
        bad.append(f"{int(metrics['trainable_tower_params'])} tower parameters train despite {FROZEN}")
    assert not bad, "\n".join(bad)
