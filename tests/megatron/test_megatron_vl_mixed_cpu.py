"""megatron_train with Qwen2.5-VL over two data-parallel gloo ranks on CPU whose rows differ: one
rank's micro-batch has images, the other's is text-only, and the next step the other way round.

With ``overlap_grad_reduce`` megatron's DDP all-reduces a bucket once each of its parameters has a
gradient, learning from the first step how many to wait for: a text-only rank never gave the vision
tower's parameters one, so the step either waited on a bucket that was never issued or issued it on
one rank only. The tower now runs on a dummy image (times 0) on a text-only training forward, so the
steps run and match ``overlap_grad_reduce: false`` bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

pytest.importorskip("megatron.core")

from two_rank_training import megatron_rank, pg_loss, raw_params, run_two_ranks, train_strategy  # noqa: E402
from vl_cases import save_tiny_vl, vl_batch  # noqa: E402

# The rows of each rank per step: vl_batch's rows 0-2 have images, row 3 is text-only.
STEPS = [[[0], [3]], [[3], [1]], [[2], [3]]]


def _train(path: str, scratch: Path, rank: int, overlap: bool) -> dict[str, torch.Tensor]:
    strategy = train_strategy(path, {"overlap_grad_reduce": overlap})
    batch = torch.load(scratch / "batch.pt", weights_only=False)
    for rows in STEPS:
        metrics = strategy.train_step([batch.index(rows[rank])], pg_loss)
        assert torch.isfinite(torch.tensor(metrics["grad_norm"])), metrics
    return raw_params(strategy)


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        overlapped = _train(path, Path(scratch), rank, overlap=True)
        synced = _train(path, Path(scratch), rank, overlap=False)
        bad += [
            f"{n} differs with overlap_grad_reduce"
            for n in synced
            if not torch.equal(synced[n], overlapped[n])
        ]


def test_text_and_image_ranks_train_with_overlapped_grad_reduce(tmp_path: Path) -> None:
    model = save_tiny_vl(tmp_path / "model")
    torch.save(vl_batch(model, tmp_path), tmp_path / "batch.pt")
    bad = run_two_ranks(_worker, (str(model), str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)
