"""Wall-clock marks of a worker's start-up, so the driver can say where a slow start-up went.

A worker marks when its process started, when it was constructed (its imports done), when
``initialize`` began and ended; spans inside it are durations: how long it waited for the
strategy's preloaded imports (``imports_wait``) and the strategy's own parts (``init_span``, e.g.
``megatron.build``). The driver turns the marks of the rank that finished last into seconds since
its own start (``roll.pipeline.rlvr.start.record_initialize``)::

    marks = StartMarks()             # in the worker's constructor: the process start, "ready"
    marks.mark("initialize")         # ... later
    with init_span("megatron.build"):  # in a strategy's initialize
        ...
    report = marks.report(seconds)   # what ``initialize`` returns: marks, its spans, take_spans()
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The marks in the order a worker passes them.
ORDER = ("process", "ready", "initialize", "initialized")

# Spans of the initialize in progress in this process (a host process initializes one member at a
# time: Worker.one_member_at_a_time).
_spans: dict[str, float] = {}


def process_started_at() -> float:
    """This process's creation time (epoch seconds, the OS's record: interpreter start and imports
    included)."""
    import psutil

    return psutil.Process().create_time()


@contextmanager
def init_span(name: str) -> Iterator[None]:
    """Add the block's seconds to span ``name`` of the initialize in progress."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _spans[name] = _spans.get(name, 0.0) + time.perf_counter() - start


def take_spans() -> dict[str, float]:
    """The spans recorded since the last call, cleared."""
    out = dict(_spans)
    _spans.clear()
    return out


class StartMarks:
    """Epoch seconds per mark, from the process start on; ``spans`` holds durations inside them."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {"process": process_started_at(), "ready": time.time()}
        self.spans: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.at[name] = time.time()
        if name == "initialize":
            take_spans()  # what an earlier initialize in this process left

    def span(self, name: str, seconds: float) -> None:
        self.spans[name] = self.spans.get(name, 0.0) + seconds

    def report(self, seconds: float) -> dict[str, Any]:
        """What a worker's ``initialize`` returns: its seconds, the marks and the spans (its own
        and those its strategy recorded with ``init_span``)."""
        spans = self.spans | take_spans()
        return {"seconds": seconds, "at": dict(self.at), "spans": spans}


def relative_marks(report: dict[str, Any], since: float) -> dict[str, float]:
    """``report``'s marks (``StartMarks.report``) as seconds after ``since`` (the driver's start),
    keyed ``at.<mark>`` in ``ORDER``, then its spans' seconds under their own names."""
    at = report.get("at", {})
    out = {f"at.{name}": at[name] - since for name in ORDER if name in at}
    return out | dict(report.get("spans", {}))
