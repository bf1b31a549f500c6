"""How a ``Cluster`` calls a worker method: ``@register`` declares the mode on the method, and the
cluster's typed method names the worker method it calls::

    class ModelWorker(Worker):
        @register(Dispatch.DP_COMPUTE)
        def compute_log_probs(self, batch: Batch, output_key: str = "old_log_probs") -> Batch: ...

    class ModelCluster(Cluster):
        def compute_log_probs(self, batch: Batch, output_key: str = "old_log_probs") -> Batch:
            return self.call(ModelWorker.compute_log_probs, batch, output_key)

    actor_train.compute_log_probs(batch)   # batch split over DP ranks, results concatenated

Modes:

- ``ONE_TO_ALL``: every worker gets the same arguments; the result is the list of every rank's return.
- ``DP_COMPUTE``: the first positional argument (a ``Batch``) is cut into ``dp_size`` equal chunks;
  every rank of DP group ``i`` gets chunk ``i`` (TP/PP ranks of one group see the same data). Only
  the output rank of each DP group is read back, in DP order; Batches are concatenated, other
  results come back as a list. (The other ranks' returns are fetched only to catch errors, so they
  should return None rather than a copy of the output.)
- ``RANK_ZERO``: only worker 0 runs it; the result is its return value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, NamedTuple, TypeVar

from roll.core.batch import Batch

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "_roll_dispatch"


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE = "dp_compute"
    RANK_ZERO = "rank_zero"


class DPRank(NamedTuple):
    """Where one worker sits in its role's data-parallel layout."""

    dp_rank: int
    dp_size: int
    is_output: bool


def register(dispatch: Dispatch = Dispatch.ONE_TO_ALL) -> Callable[[F], F]:
    """Declare how ``Cluster.call`` runs a worker method (the method itself is returned unchanged)."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"register() takes a Dispatch mode, got {dispatch!r}")

    def mark(fn: F) -> F:
        setattr(fn, _MARK, dispatch)
        return fn

    return mark


def dispatch_mode(method: Callable[..., Any]) -> Dispatch:
    """The mode ``method`` (a worker class's function) was declared with; a clear error when none was."""
    mode = getattr(method, _MARK, None)
    if not isinstance(mode, Dispatch):
        raise TypeError(
            f"{getattr(method, '__qualname__', method)!r} is not marked with @register(Dispatch...), "
            "so a Cluster does not know how to call it"
        )
    return mode


def check_dp_layout(layouts: Sequence[DPRank], role: str) -> int:
    """Check that the ranks agree on dp_size and that each DP group has one output rank; returns dp_size."""
    sizes = {layout.dp_size for layout in layouts}
    if len(sizes) != 1:
        raise ValueError(f"{role}: workers disagree on the data-parallel size: {sorted(sizes)}")
    dp_size = sizes.pop()
    outputs = sorted(layout.dp_rank for layout in layouts if layout.is_output)
    if outputs != list(range(dp_size)):
        raise ValueError(
            f"{role}: each of the {dp_size} DP groups needs exactly one output rank, got output DP ranks {outputs}"
        )
    return dp_size


def split_for_dp(batch: Batch, dp_size: int, where: str) -> list[Batch]:
    """``batch`` cut into ``dp_size`` equal chunks; DP group ``i`` gets chunk ``i``."""
    if not isinstance(batch, Batch):
        raise TypeError(
            f"{where}: DP_COMPUTE needs a Batch as the first argument, got {type(batch).__name__}"
        )
    if len(batch) % dp_size:
        raise ValueError(
            f"{where}: a batch of {len(batch)} rows does not split into {dp_size} equal DP chunks"
        )
    return batch.chunk(dp_size)


def gather_from_dp(results: Sequence[Any], layouts: Sequence[DPRank]) -> Any:
    """The output ranks' results in DP order: one concatenated Batch, or a list of other values."""
    pairs = [(layout.dp_rank, result) for layout, result in zip(layouts, results) if layout.is_output]
    values = [result for _, result in sorted(pairs, key=lambda pair: pair[0])]
    if values and all(isinstance(v, Batch) for v in values):
        return Batch.concat(values)
    return values
