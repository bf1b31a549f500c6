"""``shutdown_ray``: ``ray.shutdown()`` with a deadline, for a driver that is about to exit.

``ray.shutdown()`` disconnects the driver's core worker from the GCS and then stops the Ray
processes this driver started, giving each kind a second to exit after SIGTERM. When Ray's own
processes are already dying (a SIGTERM to the driver's process group, as ``timeout``, systemd or
Ctrl-C send) the disconnect waits on them and the whole call took 8-10 s on the CPU test machine,
long enough for ``timeout -k 10`` to kill the driver after it had printed its last line. Here the
call runs on a thread for at most ``grace_s``; past that, the local Ray processes are killed
(SIGKILL) and the caller is told to leave without further clean-up::

    if not shutdown_ray(RAY_SHUTDOWN_GRACE_S):
        os._exit(code)      # ray.shutdown is still blocked on a thread; its atexit hook would be too
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import ray

# How long a driver's ray.shutdown() may take before Ray's local processes are killed instead.
# A healthy local Ray shuts down in about 1 s on the CPU test machine.
RAY_SHUTDOWN_GRACE_S = 3.0

logger = logging.getLogger("roll")


def shutdown_ray(grace_s: float = RAY_SHUTDOWN_GRACE_S) -> bool:
    """Shut Ray down within ``grace_s`` seconds; True when it did (or Ray was not running). False:
    the shutdown is still blocked on a daemon thread, and the Ray processes this driver started
    (GCS, raylet, ...) have been killed; the process should exit with ``os._exit``."""
    if not ray.is_initialized():
        return True
    node = getattr(ray._private.worker, "_global_node", None)  # the local Ray this driver started
    if run_with_deadline(_shutdown, grace_s, "roll-ray-shutdown"):
        return True
    logger.debug("ray.shutdown() did not end within %g s; killing the local Ray processes", grace_s)
    _kill_processes(node)
    return False


def run_with_deadline(fn: Callable[[], object], timeout_s: float, name: str) -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout_s``; True when it finished. A call
    still blocked (on a dead or dying Ray) is left running and does not keep the process alive."""
    thread = threading.Thread(target=fn, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def _shutdown() -> None:
    try:
        ray.shutdown()
    except Exception as exc:  # noqa: BLE001 - the driver is leaving either way
        logger.debug("ray.shutdown() failed: %s", exc)


def _kill_processes(node) -> None:
    """SIGKILL every process of ``node`` (a ``ray._private.node.Node``) still running."""
    if node is None:
        return
    for infos in list(getattr(node, "all_processes", {}).values()):
        for info in infos:
            if info.process.poll() is None:
                info.process.kill()
