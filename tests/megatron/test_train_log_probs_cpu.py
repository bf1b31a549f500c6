"""megatron_train's training forward gives the old log-probs (``records_train_log_probs``).

With one optimizer step per RL step, ``recompute_old_log_probs: auto`` takes the old log-probs from
the training forward instead of a separate ``compute_log_probs`` pass (the 1.5B pipeline spent
2.0-2.5 s a step on that pass). That is only right if every row's log-probs reach the loss, on the
rank whose outputs count (``dp_layout``), equal to what the pass gives.

Two ranks (gloo, fp32, the CPU shims), a tiny 2-layer Qwen2, for each layout -- TP=2 + SP, PP=2,
DP=2 padded, and DP=2 packed under a token budget that moves rows between the ranks -- the output ranks'
recorded log-probs and entropies, gathered and put back in row order as the driver does, equal
the pass's before the step.
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

from two_rank_training import megatron_rank, pg_batch, pg_loss, run_two_ranks, save_tiny_qwen2, train_strategy  # noqa: E402

from roll.core.batch import Batch  # noqa: E402
from roll.core.loss import ROW_INDEX, LogProbRecorder  # noqa: E402
from roll.pipeline.workers.model_worker import in_row_order  # noqa: E402

LAYOUTS = {
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True, "sequence_packing": False},
    "pp2": {"pipeline_model_parallel_size": 2, "sequence_packing": False},
    "dp2_padded": {"sequence_packing": False},
    "dp2_packed_budget": {"sequence_packing": True, "max_tokens_per_microbatch": 40},
}


def check(path: str, name: str) -> list[str]:
    strategy = train_strategy(path, LAYOUTS[name])
    dp_rank, dp_size, is_output = strategy.dp_layout()
    full = pg_batch(3, rows=8)
    full = full.union(Batch.from_dict({ROW_INDEX: torch.arange(len(full))}))  # global, as the driver's
    before = strategy.compute_log_probs(full)  # every DP rank scores the whole batch
    recorder = LogProbRecorder(pg_loss)
    strategy.train_step(full.chunk(dp_size)[dp_rank].split(2), recorder)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, recorder.batch() if is_output else None)
    if dist.get_rank() != 0:
        return []
    recorded = in_row_order(Batch.concat([p for p in parts if p is not None]), len(full), "actor_train")
    bad = []
    for key, want in (("old_log_probs", before["log_probs"]), ("entropy", before["entropy"])):
        got = recorded[key]
        if not torch.allclose(got, want, rtol=0, atol=1e-5):
            bad.append(f"{name}: {key} differs by {float((got - want).abs().max()):.2e}")
    if float(before["log_probs"].abs().sum()) == 0:
        bad.append(f"{name}: the pass gave zeros (the comparison would be vacuous)")
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        for name in LAYOUTS:
            bad += check(path, name)
            dist.barrier()


def test_training_forward_records_the_old_log_probs(tmp_path: Path) -> None:
    path = save_tiny_qwen2(tmp_path / "model", layers=2)
    bad = run_two_ranks(_worker, (path, str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)
