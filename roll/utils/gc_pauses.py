"""Pauses of Python's garbage collector in this process, summed until ``take``.

A full collection walks every live Python object; in a driver that holds many of them it stops
every thread for a noticeable time, and the stage that happens to be running when it triggers
looks slower. The RLVR driver logs these per step (``perf/driver_gc_s``, the sum, and
``perf/driver_gc_max_s``, the longest single pause), so a slow stage can be told apart from a
collection that landed in it::

    pauses = GcPauses()          # starts counting (a gc callback)
    ...
    metrics |= pauses.take()     # seconds since the last take, then zeroed
    pauses.close()               # stops counting
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


class GcPauses:
    """Sums the wall time of every collection (all generations, any thread) until ``take``."""

    def __init__(self, prefix: str = "perf/driver_gc") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}  # thread id -> start of its collection in progress
        self._total = 0.0
        self._longest = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = now
            return
        start = self._started.pop(thread, None)
        if start is None:  # counting began during this collection
            return
        with self._lock:
            self._total += now - start
            self._longest = max(self._longest, now - start)

    def take(self) -> dict[str, float]:
        """``{prefix}_s`` (all pauses) and ``{prefix}_max_s`` (the longest) since the last take."""
        with self._lock:
            out = {f"{self.prefix}_s": self._total, f"{self.prefix}_max_s": self._longest}
            self._total = self._longest = 0.0
        return out

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
