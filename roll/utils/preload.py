"""Import modules on a background thread, so a slow import overlaps other start-up work.

A GPU worker of an engine strategy starts importing its engine (``StrategySpec.preload``) when
the worker is constructed; the strategy's own import later in ``initialize`` then finds the module
loaded, or waits on Python's module lock for the import in progress, and reports any error itself
(this thread only logs it)::

    thread = preload(("vllm.entrypoints.llm",))   # returns at once
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
import time
from collections.abc import Iterable

logger = logging.getLogger("roll")


def preload(modules: Iterable[str]) -> threading.Thread | None:
    """Start importing ``modules`` (those that are installed) on a daemon thread; None if none is."""
    wanted = [name for name in modules if _installed(name)]
    if not wanted:
        return None
    thread = threading.Thread(target=_import_all, args=(wanted,), name="roll-preload", daemon=True)
    thread.start()
    return thread


def _installed(name: str) -> bool:
    return is_installed(name.split(".")[0])


def is_installed(module: str) -> bool:
    """Whether ``module`` (``vllm``, ``megatron.core``) can be imported here, found without importing
    it (a dotted name imports its parent packages only)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def _import_all(modules: list[str]) -> None:
    for name in modules:
        start = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the strategy's own import reports it with context
            logger.debug("preload of %s failed: %s", name, exc)
            return
        logger.debug("preloaded %s in %.1f s", name, time.perf_counter() - start)
