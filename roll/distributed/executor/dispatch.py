"""How a ``Cluster`` calls a worker method: ``@register`` marks the method, the cluster reads the mark.

>>> class ActorWorker(Worker):
...     @register(Dispatch.DP_COMPUTE)
...     def compute_log_probs(self, batch: Batch) -> Batch: ...
>>> actor_train.compute_log_probs(batch)   # batch split over DP ranks, results concatenated

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

import functools
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, NamedTuple, TypeVar

from roll.core.batch import Batch
from roll.distributed.executor.faults import inject_fault

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
    """Mark a worker method so ``cluster.<method>(...)`` knows how to call it."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"register() takes a Dispatch mode, got {dispatch!r}")

    def mark(fn: F) -> F:
        @functools.wraps(fn)
        def call(self, *args: Any, **kwargs: Any) -> Any:
            inject_fault(self, fn.__name__)  # no-op unless ROLL_INJECT_FAULT is set
            return fn(self, *args, **kwargs)

        setattr(call, _MARK, dispatch)
        return call  # type: ignore[return-value]

    return mark


def dispatch_mode(worker_cls: type, method: str) -> Dispatch:
    """The mode ``method`` of ``worker_cls`` was registered with; a clear error when it was not."""
    fn = getattr(worker_cls, method, None)
    if not callable(fn):
        raise AttributeError(f"{worker_cls.__name__} has no method {method!r}")
    mode = getattr(fn, _MARK, None)
    if mode is None:
        raise AttributeError(
            f"{worker_cls.__name__}.{method} is not marked with @register(Dispatch...); mark it, or call "
            f"cluster.execute_all({method!r}, ...)"
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
