"""Micro-batches formed by a token budget, and loss weights that keep the mini-batch's aggregation.

``plan_micro_batches`` sorts rows longest first and gives each to the least-loaded micro-batch
(LPT greedy bin packing), so micro-batches carry about the same number of tokens and none exceeds
``max_tokens``. A train step (``rebudget``) plans the rows of all data-parallel ranks together and
deals the micro-batches out (``deal``): every rank runs the same number of forwards/backwards with
about the same tokens, so none waits. Log-prob passes (``split_by_tokens``) keep each rank's rows
(their results go back in order) and agree on the number of micro-batches by an all-reduce.

``loss_weights`` replaces the old ``1 / len(micro_batches)`` scaling: micro-batch ``i``'s loss
(aggregated by ``loss_agg_mode`` over its own rows) is weighted by its share of the mini-batch's
normaliser, summed over all data-parallel ranks: tokens for ``token-mean``, non-empty sequences for
the ``seq-mean-*`` modes. The summed gradient is then exactly that of the loss aggregated over the
whole mini-batch at once, however the rows are split into micro-batches or ranks.

>>> parts, order = split_by_tokens(batch, max_tokens=8192, group=dp_group)
>>> weights = loss_weights(parts, loss_agg_mode_of(loss_fn), group=dp_group)
>>> for part, w in zip(parts, weights): (loss_fn(forward(part), part)[0] * w).backward()
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from roll.core.batch import Batch
from roll.models.packing import sequence_lengths


def _lpt(lengths: Sequence[int], max_tokens: int, bins: int) -> list[list[int]] | None:
    """Longest first into the least-loaded of ``bins`` bins; None when a row does not fit."""
    heap = [(0, b) for b in range(bins)]
    plan: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        if load + lengths[i] > max_tokens:
            return None
        plan[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return plan


def min_micro_batches(lengths: Sequence[int], max_tokens: int) -> int:
    """The fewest micro-batches LPT needs to keep each under ``max_tokens``."""
    if not lengths:
        return 0
    bins = max(1, math.ceil(sum(lengths) / max_tokens))
    while _lpt(lengths, max_tokens, bins) is None:
        bins += 1
    return bins


def _split_fullest(plan: list[list[int]], lengths: Sequence[int]) -> None:
    """Move the shortest row of the heaviest splittable micro-batch into a new one."""
    candidates = [b for b in plan if len(b) > 1]
    heaviest = max(candidates, key=lambda b: sum(lengths[i] for i in b))
    shortest = min(heaviest, key=lambda i: lengths[i])
    heaviest.remove(shortest)
    plan.append([shortest])


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, num_micro_batches: int | None = None
) -> list[list[int]]:
    """Row indices of each micro-batch: every row once, at most ``max_tokens`` tokens each, about
    equal loads; exactly ``num_micro_batches`` of them when given (at least the minimum, at most
    the number of rows). Rows inside a micro-batch are in their original order."""
    too_long = [n for n in lengths if n > max_tokens]
    if too_long:
        raise ValueError(
            f"max_tokens_per_microbatch: a sequence of {max(too_long)} tokens exceeds the budget of "
            f"{max_tokens}; raise the budget to at least the longest prompt + response"
        )
    bins = num_micro_batches or min_micro_batches(lengths, max_tokens)
    if bins > len(lengths):
        raise ValueError(f"cannot form {bins} non-empty micro-batches from {len(lengths)} rows")
    plan = _lpt(lengths, max_tokens, bins)
    if plan is None:  # LPT is not monotone in the bin count: split the minimal plan instead
        plan = _lpt(lengths, max_tokens, min_micro_batches(lengths, max_tokens))
        while len(plan) < bins:
            _split_fullest(plan, lengths)
    return [sorted(b) for b in plan]


def all_reduce_values(values: list[float], op: Any, group: Any) -> list[float]:
    """``values`` reduced by ``op`` over the ranks of ``group`` (as they are without one), in fp64
    on CPU, or on the GPU for an NCCL-only group."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.cpu().tolist()


def split_by_tokens(
    batch: Batch, max_tokens: int, group: Any = None, min_count: int = 1
) -> tuple[list[Batch], list[int]]:
    """(micro-batches of at most ``max_tokens`` real tokens, the row order they hold): the same
    number of micro-batches on every rank of ``group``, at least ``min_count`` when the rows allow.
    ``Batch.concat(parts)`` holds the rows in ``order``; ``invert(order)`` puts per-row results
    back in the batch's order."""
    lengths = sequence_lengths(batch).tolist()
    needed = min_micro_batches(lengths, max_tokens) if max(lengths) <= max_tokens else 1
    needed = max(needed, min(min_count, len(lengths)))
    agreed = [float(needed), -float(len(lengths)), float(max(lengths))]
    count, fewest, longest = all_reduce_values(agreed, dist.ReduceOp.MAX, group)
    # Errors are raised on every rank alike, so none is left waiting in a collective.
    if longest > max_tokens:
        plan_micro_batches([int(longest)], max_tokens)  # raises the budget error
    if count > -fewest:
        raise ValueError(
            f"max_tokens_per_microbatch: {int(count)} micro-batches are needed, but a data-parallel "
            f"rank has only {int(-fewest)} rows; raise the budget"
        )
    plan = plan_micro_batches(lengths, max_tokens, int(count))
    order = [i for part in plan for i in part]
    return [batch.index(part) for part in plan], order


def deal(loads: Sequence[int], ranks: int, per_rank: int) -> list[int]:
    """The rank of each micro-batch: heaviest first, each to the least-loaded rank that still has
    room, so every rank gets ``per_rank`` micro-batches and about the same tokens."""
    totals, counts, owner = [0] * ranks, [0] * ranks, [0] * len(loads)
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        rank = min((r for r in range(ranks) if counts[r] < per_rank), key=lambda r: (totals[r], r))
        owner[i], totals[rank], counts[rank] = rank, totals[rank] + loads[i], counts[rank] + 1
    return owner


def _balanced(batch: Batch, max_tokens: int, group: Any) -> list[Batch]:
    """This rank's micro-batches planned over the rows of every rank of ``group`` (exchanged)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, batch.to("cpu"), group=group)
    rows = Batch.concat(everyone)
    lengths = sequence_lengths(rows).tolist()
    ranks = len(everyone)
    per_rank = math.ceil(min_micro_batches(lengths, max_tokens) / ranks) if max(lengths) <= max_tokens else 1
    plan = plan_micro_batches(lengths, max_tokens, per_rank * ranks)  # raises on every rank alike
    owner = deal([sum(lengths[i] for i in part) for part in plan], ranks, per_rank)
    mine = dist.get_rank(group)
    return [rows.index(part) for part, rank in zip(plan, owner) if rank == mine]


def rebudget(batches: list[Batch], max_tokens: int | None, group: Any = None) -> list[Batch]:
    """A train step's micro-batches re-formed by ``max_tokens`` (unchanged when None). Over a
    ``group`` of data-parallel ranks (each holding different rows) the rows of all ranks are
    planned together and exchanged: every rank gets the same number of micro-batches with about
    the same number of tokens, so none waits for a busier one."""
    if max_tokens is None:
        return batches
    batch = Batch.concat(batches)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return split_by_tokens(batch, max_tokens)[0]
    return _balanced(batch, max_tokens, group)


def invert(order: Sequence[int]) -> torch.Tensor:
    """Indices that undo a permutation: ``x[order][invert(order)] == x``."""
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.as_tensor(list(order), dtype=torch.long)] = torch.arange(len(order))
    return inverse


def _normaliser(batch: Batch, mode: str) -> float:
    # The tokens the loss is taken over: SFT batches mark them in ``loss_mask`` (assistant turns
    # only); RL batches take every response token.
    mask = (batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]).bool()
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


def loss_weights(batches: list[Batch], mode: str | None, group: Any = None) -> list[float]:
    """Weight of each micro-batch's loss (see the module docstring). Gradients averaged over the
    ``group``'s ranks (DDP, FSDP) are accounted for: weights sum to the group size over all ranks.
    ``mode`` None (a loss function that does not say how it aggregates): ``1 / len(batches)``."""
    if mode is None:
        return [1.0 / len(batches)] * len(batches)
    counts = [_normaliser(b, mode) for b in batches]
    (total,) = all_reduce_values([sum(counts)], dist.ReduceOp.SUM, group)
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    return [c * size / max(total, 1.0) for c in counts]


def loss_agg_mode_of(loss_fn: Callable) -> str | None:
    """The ``loss_agg_mode`` a loss function aggregates by, as the factories in
    ``roll.pipeline.rlvr.algorithms.losses`` bind it (``functools.partial``); None when unknown."""
    keywords = getattr(loss_fn, "keywords", None) or {}
    return keywords.get("loss_agg_mode")
