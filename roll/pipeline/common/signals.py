"""SIGTERM and SIGINT (Ctrl-C) on the driver end the run the way an error does, without a traceback.

The first signal raises ``RunInterrupted`` in the driver's main thread, wherever it waits (Ray's
waits check for signals); the pipeline's clean-up then kills the workers and the launcher shuts Ray
down and exits with ``128 + signal number`` (143 for SIGTERM, 130 for SIGINT). A second signal
during that clean-up, or a clean-up still running after ``CLEANUP_GRACE_S``, ends the driver at once.

Ray's ``ray.init`` installs its own SIGTERM handler in the driver (``sys.exit``, with a C++ stack
dump); ``ray_start.init_ray`` puts these back after it::

    take_signals()                # init_ray keeps these handlers (Ray's init replaces them)
    try:
        run_pipeline(config)
    except KeyboardInterrupt:     # Ray may re-raise it as a plain KeyboardInterrupt
        sys.exit(interruption().exit_code)

Once the run has a log, ``divert_output_on_signal(run_log)`` makes the first signal also send the
process's stdout and stderr (file descriptors 1 and 2) to that file: what the clean-up shakes
loose (Ray forwarding a dying worker's traceback, a driver thread's exception, Ray's error
messages) is kept there instead of printed around the one line, which goes to ``terminal()``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TextIO

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The clean-up after a signal gets this long; then the driver leaves without it (a clean-up can
# block when the signal also reached Ray's own processes, e.g. SIGTERM to the process group).
CLEANUP_GRACE_S = 60.0
# Ray checks this variable each time it would print an error nobody waited for.
QUIET_RAY_ERRORS = "RAY_IGNORE_UNHANDLED_ERRORS"


class RunInterrupted(KeyboardInterrupt):
    """The driver got SIGTERM or SIGINT. A KeyboardInterrupt, so that no ``except Exception`` on
    the way up swallows it, and because Ray's waits turn any KeyboardInterrupt raised inside them
    into a fresh one (other exception types break them): catch ``KeyboardInterrupt`` and ask
    ``interruption()`` which signal it was."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {self.name}")


_interrupted: list[int] = []
_timers: list[threading.Timer] = []
_divert_to: list[Path] = []  # the file that takes fds 1 and 2 after a signal (the run's log)
_terminal: list[TextIO] = []  # the process's stderr as it was before the diversion


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _interrupted:  # a second signal while the first one's clean-up runs: leave now
        os._exit(128 + signum)
    _interrupted.append(signum)
    # The calls in flight fail as the clean-up kills their workers (a checkpoint half written, a
    # generate cut off); Ray would print each failure's traceback as an "Unhandled error" around
    # the one line the launcher prints.
    os.environ[QUIET_RAY_ERRORS] = "1"
    _divert_output()
    timer = threading.Timer(CLEANUP_GRACE_S, _leave, (signum,))
    timer.daemon = True
    timer.start()
    _timers.append(timer)
    raise RunInterrupted(signum)


def _leave(signum: int) -> None:
    name = signal.Signals(signum).name
    out = terminal()
    print(f"roll: stopped by {name}; the clean-up did not end within {CLEANUP_GRACE_S:g} s", file=out)
    out.flush()
    os._exit(128 + signum)


def interruption() -> RunInterrupted:
    """The RunInterrupted for the signal that arrived (SIGINT when none did: a KeyboardInterrupt
    raised some other way)."""
    return RunInterrupted(_interrupted[0] if _interrupted else signal.SIGINT)


def divert_output_on_signal(path: Path) -> None:
    """From the first signal on, append this process's stdout and stderr to ``path``."""
    _divert_to[:] = [path]


def _divert_output() -> None:
    if not _divert_to or _terminal:
        return
    try:
        fd = os.open(_divert_to[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:  # the output_dir is gone or full: keep printing to the terminal
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (RuntimeError, OSError, ValueError):
            # The signal came while this thread was writing to the stream (a reentrant flush is a
            # RuntimeError); its buffered bytes go to the log with the next flush instead.
            pass
    _terminal.append(os.fdopen(os.dup(2), "w", buffering=1))
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


def terminal() -> TextIO:
    """Where the run's last line goes: stderr as it was before a signal diverted it."""
    return _terminal[0] if _terminal else sys.stderr


def output_diverted() -> bool:
    """Whether a signal has sent stdout and stderr to the run's log (a console handler that writes
    there would write each line twice)."""
    return bool(_terminal)


def take_signals() -> None:
    """Make SIGTERM and SIGINT raise ``RunInterrupted`` (call it from the main thread)."""
    _interrupted.clear()
    _divert_to.clear()  # a run that sets up its log names it again
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)


def release_signals() -> None:
    """Give SIGTERM and SIGINT back their default actions; the clean-up is over (no deadline)."""
    for timer in _timers:
        timer.cancel()
    _timers.clear()
    for signum in SIGNALS:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
