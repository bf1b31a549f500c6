"""The driver's garbage-collection pause meter (roll.utils.gc_pauses)."""

from __future__ import annotations

import gc
import time

from roll.utils.gc_pauses import GcPauses


class Node:
    def __init__(self) -> None:
        self.other = self  # a reference cycle: only the collector frees it


def test_collections_are_summed_until_take_and_then_zeroed():
    pauses = GcPauses()
    try:
        pauses.take()  # whatever ran before this point
        start = time.perf_counter()
        nodes = [Node() for _ in range(200_000)]  # allocations trigger young collections too
        del nodes
        full = time.perf_counter()
        gc.collect()
        end = time.perf_counter()
        got = pauses.take()
        assert 0 < got["perf/driver_gc_max_s"] <= got["perf/driver_gc_s"] <= end - start
        assert got["perf/driver_gc_max_s"] >= 0.5 * (end - full)  # the full collection's pause
        assert pauses.take()["perf/driver_gc_s"] < got["perf/driver_gc_s"]  # zeroed by take
    finally:
        pauses.close()
    assert pauses._callback not in gc.callbacks
    gc.collect()
    assert pauses.take() == {"perf/driver_gc_s": 0.0, "perf/driver_gc_max_s": 0.0}  # stopped counting
