"""Wall seconds of a run's stages, as metrics: ``time/<stage>`` and their sum ``time/step``.

    timer = StageTimer()
    with timer("train"):
        ...
    tracker.log(metrics | timer.metrics(), step)

The RLVR and SFT step loops time their stages with it, and the RLVR start-up times its phases with
one more (``startup/*`` metrics, ``roll.pipeline.rlvr.perf.startup_metrics``). ``SwapTimes`` adds up
the seconds colocated RLVR roles spend moving onto and off their devices (``swap/*`` metrics).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager


@contextmanager
def adding_seconds(store: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's wall seconds to ``store[key]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        store[key] = store.get(key, 0.0) + time.perf_counter() - start


class StageTimer:
    """``with timer("generate"): ...`` records ``time/generate``; ``time/step`` is their sum."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        # Stages that ran in the background (asynchronous generation): reported, not in time/step.
        self.background: dict[str, float] = {}

    def __call__(self, name: str) -> AbstractContextManager[None]:
        # A stage timed more than once in a step (sampling rounds) adds up.
        return adding_seconds(self.times, f"time/{name}")

    def metrics(self) -> dict[str, float]:
        return self.background | self.times | {"time/step": sum(self.times.values())}


class SwapTimes:
    """Seconds colocated roles spent being reloaded onto and offloaded from their devices, summed
    per role and direction until ``take`` (once a step)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def timed(self, role: str, direction: str) -> AbstractContextManager[None]:
        return adding_seconds(self.seconds, f"swap/{role}/{direction}_s")

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out
