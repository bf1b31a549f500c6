"""megatron_train options of the MoE SFT recipes, on two CPU ranks (gloo, fp32, the CPU shims):

1. ``freeze_moe_router`` at EP=2: after a training step every router weight is bit-identical to its
   start while the other weights moved; without it the routers move too (the control).
2. ``num_layers_in_first_pipeline_stage`` at PP=2 on a 3-layer Qwen2: stage 0 holds 2 layers,
   stage 1 holds 1, and the log-probs match the unsplit model's (DP=2) to rounding.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

pytest.importorskip("megatron.core")

from tiny_models import build_tiny_tokenizer  # noqa: E402
from two_rank_training import (
    megatron_rank,
    pg_batch,
    pg_loss,
    raw_params,
    run_two_ranks,
    save_tiny_qwen2,
    train_strategy,
)  # noqa: E402

from roll.models.megatron.hf_io import unwrap  # noqa: E402


def _router_checks(path: str) -> list[str]:
    bad = []
    for freeze in (True, False):
        strategy = train_strategy(path, {"expert_model_parallel_size": 2, "freeze_moe_router": freeze})
        before = raw_params(strategy)
        dp_rank, dp_size, _ = strategy.dp_layout()
        strategy.train_step(pg_batch(0).chunk(dp_size)[dp_rank].split(1), pg_loss)
        after = raw_params(strategy)
        routers = [n for n in before if ".mlp.router." in n]
        moved = [n for n in before if not torch.equal(before[n], after[n])]
        if not routers:
            bad.append("no router parameters found")
        if freeze and set(moved) & set(routers):
            bad.append(f"frozen routers changed: {sorted(set(moved) & set(routers))}")
        if not freeze and not set(moved) & set(routers):
            bad.append("control: unfrozen routers did not change (the check would be vacuous)")
        if not set(moved) - set(routers):
            bad.append(f"freeze={freeze}: no other weight changed")
    return bad


def _uneven_checks(path: str) -> list[str]:
    bad = []
    batch = pg_batch(3)
    reference = train_strategy(path, {}).compute_log_probs(batch)["log_probs"]
    split = train_strategy(path, {"pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": 2})
    layers = len(unwrap(split.model[0]).decoder.layers)
    if layers != (2 if dist.get_rank() == 0 else 1):
        bad.append(f"stage {dist.get_rank()} holds {layers} layers")
    log_probs = split.compute_log_probs(batch)["log_probs"]
    if not torch.allclose(log_probs, reference, atol=1e-5):
        bad.append(f"log-probs differ by {float((log_probs - reference).abs().max()):.2e}")
    return bad


CHECKS = {"router": _router_checks, "uneven": _uneven_checks}


def _worker(rank: int, world_size: int, port: int, checks: str, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch, timeout=datetime.timedelta(seconds=120)) as bad:
        bad += CHECKS[checks](path)


def _run(checks: str, path: str, scratch: Path) -> None:
    bad = run_two_ranks(_worker, (checks, path, str(scratch)), scratch)
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_freeze_moe_router_keeps_routers_fixed(tmp_path: Path) -> None:
    from roll.models.random_checkpoint import write_random_checkpoint

    build_tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    path = write_random_checkpoint(
        "tiny-qwen3-moe", tmp_path / "model", tokenizer_dir=tmp_path / "tokenizer", dtype=torch.float32
    )
    _run("router", str(path), tmp_path)


@pytest.mark.slow
def test_uneven_first_stage_matches_the_unsplit_model(tmp_path: Path) -> None:
    _run("uneven", save_tiny_qwen2(tmp_path / "model", layers=3), tmp_path)
