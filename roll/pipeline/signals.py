"""SIGTERM and SIGINT (Ctrl-C) on the driver end the run the way an error does, without a traceback.

The first signal raises ``RunInterrupted`` in the driver's main thread, wherever it waits (Ray's
waits check for signals); the pipeline's clean-up then kills the workers and the launcher shuts Ray
down and exits with ``128 + signal number`` (143 for SIGTERM, 130 for SIGINT). A second signal
during that clean-up ends the driver at once.

Ray's ``ray.init`` installs its own SIGTERM handler in the driver (``sys.exit``, with a C++ stack
dump), so ``take_signals`` must run again after Ray is up::

    take_signals()
    init_ray(plan, device)
    take_signals()
    try:
        run_pipeline(config)
    except RunInterrupted as stop:
        sys.exit(stop.exit_code)
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)
logger = logging.getLogger("roll")


class RunInterrupted(BaseException):
    """The driver got SIGTERM or SIGINT. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way up swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {self.name}")


_interrupted: list[int] = []


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _interrupted:  # a second signal while the first one's clean-up runs: leave now
        os._exit(128 + signum)
    _interrupted.append(signum)
    raise RunInterrupted(signum)


def take_signals() -> None:
    """Make SIGTERM and SIGINT raise ``RunInterrupted`` (call it from the main thread)."""
    _interrupted.clear()
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)


def release_signals() -> None:
    """Give SIGTERM and SIGINT back their default actions."""
    for signum in SIGNALS:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
