"""Qwen2.5-VL on the Megatron strategies, two gloo ranks on CPU (fp32), tiny model (tests/tiny_vl.py).

- log-probs of image rows (and a text row) equal transformers' with its 3-D rope positions, on
  megatron_train with DP=2, TP=2 + SP and PP=2, and on megatron_infer (a reference) with TP=2;
- the weights round-trip: the HF export is the checkpoint's tensors under transformers 5's module
  names, bit for bit, and an HF checkpoint saved from megatron loads in transformers;
- a train step reaches the vision tower, and ``freeze_module_prefix: model.visual`` (ROLL's key)
  keeps it as it was while the language model trains (TP=2 + SP, and PP=2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

import vl_checks  # noqa: E402
from two_rank_training import (  # noqa: E402
    megatron_rank,
    pg_loss,
    raw_params,
    run_two_ranks,
    train_strategy,
)
from vl_cases import save_case, save_tiny_vl  # noqa: E402
from vl_checks import check_saved, export_and_save  # noqa: E402

from roll.models.megatron.weight_mapping import VL_LANGUAGE  # noqa: E402

SCORING = dict(vl_checks.SCORING)  # the Qwen3-VL(-MoE) tests add their cases


def _module_name(name: str) -> str:
    return "model." + name if name.startswith("visual.") else VL_LANGUAGE + name.removeprefix("model.")


def check_log_probs(path: str, scratch: Path, name: str) -> list[str]:
    """The ``SCORING`` case ``name``: log-probs equal transformers' within 1e-4."""
    return vl_checks.check_log_probs(path, scratch, name, *SCORING[name])


def check_round_trip(path: str, scratch: Path) -> list[str]:
    from safetensors.torch import load_file

    stored = {_module_name(n): t for n, t in load_file(Path(path) / "model.safetensors").items()}
    bad, out = export_and_save(path, scratch, stored)
    if dist.get_rank() == 0:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
        state = {
            _module_name(n) if not n.startswith(("model.", "lm_head")) else n: t
            for n, t in model.state_dict().items()
        }
        bad += check_saved(stored, state)
    return bad


TRAINING = {
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},  # the first stage sends the image-filled embeddings
}


def check_train_step(path: str, scratch: Path, freeze: bool, layout: str = "tp2_sp") -> list[str]:
    args = {"freeze_module_prefix": ["model.visual"]} if freeze else {}
    strategy = train_strategy(path, TRAINING[layout], **args)
    batch = torch.load(scratch / "batch.pt", weights_only=False)
    before = raw_params(strategy)
    metrics = strategy.train_step(batch.split(2), pg_loss)
    after = raw_params(strategy)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    tag, bad = f"train step ({layout}, freeze={freeze})", []
    if not (torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0):
        bad.append(f"{tag}: metrics {metrics}")
    vision = {n for n in before if n.startswith("visual.")}  # none on the second pipeline stage
    if freeze and moved & vision:
        bad.append(f"{tag}: the frozen tower changed: {sorted(moved & vision)[:3]}")
    if not freeze and not vision <= moved:
        bad.append(f"{tag}: tower weights without an update: {sorted(vision - moved)[:3]}")
    if not moved - vision:
        bad.append(f"{tag}: the language model did not change")
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        for name in SCORING:
            bad += check_log_probs(path, Path(scratch), name)
            dist.barrier()
        bad += check_round_trip(path, Path(scratch))
        dist.barrier()
        for freeze, layout in ((False, "tp2_sp"), (True, "tp2_sp"), (False, "pp2")):
            bad += check_train_step(path, Path(scratch), freeze, layout)
            dist.barrier()


def test_megatron_qwen2_5_vl_scores_round_trips_and_trains(tmp_path: Path) -> None:
    model = save_tiny_vl(tmp_path / "model")
    save_case(model, tmp_path)
    bad = run_two_ranks(_worker, (str(model), str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)
