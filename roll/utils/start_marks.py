"""Wall-clock marks of a worker's start-up, so the driver can say where a slow start-up went.

A worker marks when its process started, when it was constructed (its imports done), when
``initialize`` began and ended, and how long that waited for the strategy's preloaded imports. The
driver turns the marks of the rank that finished last into seconds since its own start
(``roll.pipeline.rlvr.start.record_initialize``)::

    marks = StartMarks()             # in the worker's constructor: the process start, "ready"
    marks.mark("initialize")         # ... later
    report = marks.report(seconds)   # what ``initialize`` returns to the driver
"""

from __future__ import annotations

import time
from typing import Any

# The marks in the order a worker passes them.
ORDER = ("process", "ready", "initialize", "initialized")


def process_started_at() -> float:
    """This process's creation time (epoch seconds, the OS's record: interpreter start and imports
    included)."""
    import psutil

    return psutil.Process().create_time()


class StartMarks:
    """Epoch seconds per mark, from the process start on; ``waits`` holds durations inside them."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {"process": process_started_at(), "ready": time.time()}
        self.waits: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.at[name] = time.time()

    def wait(self, name: str, seconds: float) -> None:
        self.waits[name] = self.waits.get(name, 0.0) + seconds

    def report(self, seconds: float) -> dict[str, Any]:
        """What a worker's ``initialize`` returns: its seconds, the marks and the waits."""
        return {"seconds": seconds, "at": dict(self.at), "waits": dict(self.waits)}


def relative_marks(report: dict[str, Any], since: float) -> dict[str, float]:
    """``report``'s marks (``StartMarks.report``) as seconds after ``since`` (the driver's start),
    in ``ORDER``, then its waits as durations (``<name>_wait``)."""
    at = report.get("at", {})
    out = {name: at[name] - since for name in ORDER if name in at}
    return out | {f"{name}_wait": value for name, value in report.get("waits", {}).items()}
