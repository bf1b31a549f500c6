"""``gloo_ranks``: spawned ranks join one gloo group, and a rank that fails fails the test quickly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import process_group, spawn_ranks


def _sum_worker(rank: int, world_size: int, port: int, out: str) -> None:
    with process_group(rank, world_size, port):
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        Path(out, f"rank{rank}.txt").write_text(f"{world_size} {value.item()} {torch.get_num_threads()}")
    assert not dist.is_initialized()  # left the group on the way out


def _failing_worker(rank: int, world_size: int, port: int) -> None:
    with process_group(rank, world_size, port):
        if rank == 1:
            raise ValueError("rank 1 broke")
        dist.all_reduce(torch.zeros(1))  # rank 0 waits here for a peer that has left


@pytest.mark.timeout(120)
def test_ranks_share_one_group_on_one_thread(tmp_path: Path) -> None:
    spawn_ranks(_sum_worker, 2, str(tmp_path))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["2 3.0 1", "2 3.0 1"]


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_the_spawn_without_waiting_for_the_timeout() -> None:
    """Rank 1 raises and leaves; rank 0 is then failed by gloo, not left waiting 30 minutes. Either
    rank's error may be the one mp.spawn reports first, so only the type is checked."""
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException):
        spawn_ranks(_failing_worker, 2)
    assert time.monotonic() - start < 90
