"""The run's log: INFO lines on the console, everything down to DEBUG in ``<output_dir>/run.log``.

    setup_logging(Path(config.output_dir))   # once per process; later calls keep the first set-up

The RLVR and the SFT drivers both log to the ``roll`` logger and set it up here.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from roll.pipeline.common.signals import divert_output_on_signal, output_diverted


class RunLogHandler(logging.FileHandler):
    """run.log. A record it cannot write (a full disk) is one line on stderr, once, instead of
    logging's traceback for every record; the console keeps getting them."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            print(f"roll: cannot write {self.baseFilename}: {sys.exc_info()[1]}", file=sys.stderr)


class ConsoleHandler(logging.StreamHandler):
    """The console's INFO lines, until a signal sends stderr into run.log (which has them already)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not output_diverted():
            super().emit(record)


def setup_logging(run_dir: Path) -> None:
    """Create ``run_dir`` and attach the console and run.log handlers to the ``roll`` logger (once);
    from a SIGTERM/SIGINT on, stdout and stderr go to run.log too (``signals``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    divert_output_on_signal(run_dir / "run.log")
    root = logging.getLogger("roll")
    if root.handlers:
        return
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    # The console gets INFO; run.log also keeps DEBUG lines such as a failed worker's traceback.
    for handler, level in (
        (ConsoleHandler(sys.stderr), logging.INFO),
        (RunLogHandler(run_dir / "run.log"), logging.DEBUG),
    ):
        handler.setFormatter(fmt)
        handler.setLevel(level)
        root.addHandler(handler)
    root.setLevel(logging.DEBUG)
