"""Checks of a vision-language model on packed rows, context parallelism and mixed text / image
ranks, run inside a two-rank gloo worker (``two_rank_training.megatron_rank``) on the files that
``vl_cases.save_case`` writes: the model, ``vl_cases.vl_batch`` (three image rows, a text row) and
transformers' log-probs of it.

>>> bad += check_log_probs(path, scratch, "cp2", {"context_parallel_size": 2})
>>> bad += check_gradients(path, scratch, {"context_parallel_size": 2})
>>> bad += check_mixed_ranks(path, scratch)
"""

from __future__ import annotations

from pathlib import Path

import torch
import vl_checks
from test_packing_cpu import capture_grads, compare
from two_rank_training import pg_loss, raw_params, train_strategy

# The rows of each rank per step: vl_batch's rows 0-2 have images, row 3 is text-only.
MIXED_STEPS = [[[0], [3]], [[3], [1]]]


def _strategy(path: str, layout: dict, strategy: str = "megatron_train"):
    config = {k: layout[k] for k in ("sequence_packing",) if k in layout}
    built = train_strategy(path, {k: v for k, v in layout.items() if k not in config}, strategy=strategy)
    for key, value in config.items():
        setattr(built.config, key, value)
    return built


def check_log_probs(
    path: str, scratch: Path, name: str, layout: dict, strategy: str = "megatron_train"
) -> list[str]:
    """Log-probs of the batch equal transformers' within 1e-4 (``layout`` may set ``sequence_packing``)."""
    config = {k: layout[k] for k in ("sequence_packing",) if k in layout}
    parallel = {k: v for k, v in layout.items() if k not in config}
    return vl_checks.check_log_probs(path, scratch, name, strategy, parallel, config)


def step_grads(path: str, layout: dict, batch) -> dict[str, torch.Tensor]:
    strategy = _strategy(path, layout)
    box = capture_grads(strategy)
    strategy.train_step(batch.split(2), pg_loss)
    return box["grads"]


def check_gradients(path: str, scratch: Path, layout: dict) -> list[str]:
    """One train step's reduced gradients on packed rows at ``layout`` equal padded DP=2's (both ranks
    given the whole batch), the tower's (deepstack mergers included) nonzero."""
    batch = torch.load(scratch / "batch.pt", weights_only=False)
    padded = step_grads(path, {"sequence_packing": False}, batch)
    packed = step_grads(path, {"sequence_packing": True, **layout}, batch)
    bad = compare(f"packed {layout} vs padded gradient", padded, packed)
    tower = [n for n in padded if n.startswith("visual.")]
    silent = [n for n in tower if not float(padded[n].abs().sum()) > 0 and n.endswith("weight")]
    if not tower or silent:
        bad.append(f"tower weights without a gradient: {silent[:3] or 'no tower'}")
    return bad


def _train_mixed(path: str, scratch: Path, rank: int, overlap: bool) -> dict[str, torch.Tensor]:
    strategy = _strategy(path, {"overlap_grad_reduce": overlap, "sequence_packing": True})
    batch = torch.load(scratch / "batch.pt", weights_only=False)
    for rows in MIXED_STEPS:
        metrics = strategy.train_step([batch.index(rows[rank])], pg_loss)
        assert torch.isfinite(torch.tensor(metrics["grad_norm"])), metrics
    return raw_params(strategy)


def check_mixed_ranks(path: str, scratch: Path, rank: int) -> list[str]:
    """One rank's rows text-only, the other's with an image, the next step the other way round, on
    packed rows: with ``overlap_grad_reduce`` the weights equal those trained without it, bit for bit
    (a text rank that gave the tower no gradient would leave its buckets' all-reduces unissued)."""
    overlapped = _train_mixed(path, scratch, rank, overlap=True)
    synced = _train_mixed(path, scratch, rank, overlap=False)
    return [
        f"{n} differs with overlap_grad_reduce" for n in synced if not torch.equal(synced[n], overlapped[n])
    ]
