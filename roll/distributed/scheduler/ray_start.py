"""Start or join Ray for a placement plan (``init_ray``), and the Ray quirks that needs handled.

- ``RAY_ADDRESS`` set: join that cluster; it must answer first (``check_ray_address``).
- GPU, several nodes: ``ray.init()`` joins the cluster started with ``ray start``.
- GPU, one node: join a cluster ``ray start`` began on this machine, else start a private Ray.
- CPU: a private Ray on 127.0.0.1 with one fake GPU per device slot.

What Ray reads once, when it is imported, and so could disagree with the environment a driver has
by the time it joins: ``ENABLE_RAY_CLUSTER`` (a loopback address to join; ``loopback_kept``) and the
authentication mode ``RAY_AUTH_MODE`` (``token_auth_synced``). ``ray.init`` also replaces the
driver's signal handlers (``keep_signal_handlers``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import ray

from roll.configs.errors import ConfigError
from roll.distributed.scheduler.placement import PlacementPlan
from roll.utils.ports import answers

# We set CUDA_VISIBLE_DEVICES ourselves (from the bundle probe), so Ray must not.
NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
# A single-node run's private Ray listens on loopback only (see ``start_local_ray``).
LOOPBACK = "127.0.0.1"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Seconds to wait for a Ray GCS to accept a connection before calling its address dead.
GCS_PROBE_S = 2.0


# ``device``: "auto" picks CUDA when the driver sees it.
DEVICES = ("auto", "cuda", "cpu")


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when this machine has CUDA, else "cpu"; "cuda"/"cpu" stay."""
    if device not in DEVICES:
        raise ConfigError("device", f"expected one of {list(DEVICES)}, got {device!r}")
    if device == "auto":
        import torch  # here, so the bundle probe (which imports this module) does not load torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def init_ray(plan: PlacementPlan, device: str, log_to_driver: bool = True) -> str:
    """Join or start Ray for ``plan``; returns the resolved device ("cuda" or "cpu").

    - ``RAY_ADDRESS`` set: join that cluster (multi-node: ``ray start`` on every node first).
    - GPU, several nodes: ``ray.init()`` joins the cluster started with ``ray start``.
    - GPU, one node: join a cluster started with ``ray start`` on this machine (``ray_start_address``),
      else start a private one that listens on 127.0.0.1 only.
    - CPU: start a private local Ray (127.0.0.1 only) with one fake GPU per device slot of the plan.
    An already initialized Ray (e.g. a test fixture's) is used as it is.
    """
    device = resolve_device(device)
    if ray.is_initialized():
        return device
    kwargs = {
        "include_dashboard": False,
        "log_to_driver": log_to_driver,
        "logging_level": logging.WARNING,
        "runtime_env": {"env_vars": {NOSET_CUDA: "1"}},
    }
    address = os.environ.get("RAY_ADDRESS")
    with keep_signal_handlers():
        if address:
            check_ray_address(address)
            loopback = address.partition(":")[0] == LOOPBACK
            with loopback_kept() if loopback else contextlib.nullcontext(), joining(address):
                ray.init(address=address, **kwargs)
        elif device == "cuda" and plan.num_nodes > 1:
            token_auth_synced()
            ray.init(**kwargs)
        elif device == "cuda" and _join_local_cluster(kwargs):
            pass
        elif device == "cuda":
            start_local_ray(None, kwargs)
        else:
            start_local_ray(
                plan.num_nodes * plan.devices_per_node, kwargs | {"_system_config": NO_WORKER_PRESTART}
            )
    return device


# No idle Python workers at start for a private Ray on CPU slots: every roll actor brings its own
# environment, so Ray could not hand them one, and on a small CPU machine they compete with the
# start-up. (On a GPU machine they serve the device probes; whether turning them off there helps is
# unmeasured.)
NO_WORKER_PRESTART = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def start_local_ray(num_gpus: int | None, kwargs: dict[str, Any]) -> None:
    """Start a private Ray whose every port (GCS, raylet, workers, agents) listens on 127.0.0.1 only
    (``loopback_kept``)."""
    with loopback_kept():
        ray.init(address="local", num_gpus=num_gpus, _node_ip_address=LOOPBACK, **kwargs)


@contextlib.contextmanager
def loopback_kept() -> Iterator[None]:
    """While Ray starts or joins, keep 127.0.0.1 as the node's and the GCS's address.

    Ray binds its servers to loopback only when the node's IP is 127.0.0.1, and ``ray.init`` turns a
    loopback ``_node_ip_address``, or a loopback GCS address to join, into the machine's address
    unless ``ENABLE_RAY_CLUSTER`` (env ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, read when Ray is
    imported) is off: a driver joining a cluster started on loopback (``ray start
    --node-ip-address=127.0.0.1``, benchmarks/two_nodes_one_host.py) then dialled the machine's
    address, where nothing listens, until its GCS client timed out. So the flag is off meanwhile; the
    processes started then inherit the variable."""
    from ray._private import ray_constants

    saved_env = os.environ.get(LOCAL_ONLY_ENV)
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(LOCAL_ONLY_ENV, None)
        else:
            os.environ[LOCAL_ONLY_ENV] = saved_env


def _join_local_cluster(kwargs: dict[str, Any]) -> bool:
    """Join the Ray cluster that ``ray start`` began on this machine; False when there is none."""
    address = ray_start_address()
    if address is None:
        return False
    with joining(address):
        ray.init(address=address, **kwargs)
    return True


AUTH_MODE_ENV = "RAY_AUTH_MODE"


def token_auth_synced() -> None:
    """Make Ray's authentication mode the one ``RAY_AUTH_MODE`` names now.

    Ray reads ``RAY_AUTH_MODE`` into its config once, when it is imported, and joins an address
    with that mode. A driver whose environment named token authentication only after the import (a
    test that started the cluster itself, a launcher that sets the variable in Python) sent no
    token, and the cluster's GCS refused it ("InvalidAuthToken") until the join timed out. Ray
    refreshes the same cached config when it turns token authentication on by itself. Nothing to do
    when the variable is unset (Ray's own default applies) or for a Ray without token authentication."""
    want = os.environ.get(AUTH_MODE_ENV)
    if want is None:
        return
    try:
        from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, Config, get_authentication_mode
    except ImportError:
        return
    if (get_authentication_mode() == AuthenticationMode.TOKEN) != (want.lower() == "token"):
        Config.initialize("")
    if want.lower() == "token":  # the token too is read once: take the one the environment has now
        AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def joining(address: str) -> Iterator[None]:
    """Around a join of the cluster at ``address``: Ray's authentication mode first made the
    environment's (``token_auth_synced``); a failed join then says what to check, as a cluster
    started with ``ray start`` under token authentication refuses a driver without the token and Ray
    reports only that it could not connect."""
    token_auth_synced()
    try:
        yield
    except ConnectionError as err:
        if os.environ.get(AUTH_MODE_ENV, "").lower() == "token":
            raise
        raise ConnectionError(
            f"{err} If that cluster uses token authentication (`ray start` turns it on when a token "
            f"exists), run this driver with {AUTH_MODE_ENV}=token and the cluster's token in "
            "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token."
        ) from err


def ray_start_address() -> str | None:
    """The GCS address in Ray's address file (written by ``ray start`` on this machine) when a GCS
    still answers there, else None.

    Not ``ray.init(address="auto")``: that also joins any Ray it finds running on the machine, so on
    a shared host a run joined another run's private Ray, or waited for good on a GCS that had just
    shut down."""
    from ray._private.services import find_bootstrap_address

    address = find_bootstrap_address(None)
    return address if address and answers(address, GCS_PROBE_S) else None


def check_ray_address(address: str) -> None:
    """A ``RAY_ADDRESS`` of the form ``host:port`` must answer: ``ray.init`` would otherwise retry
    for good. Other forms (``auto``, ``local``, ``ray://`` clients) are Ray's to resolve."""
    if "://" in address or address in ("auto", "local") or ":" not in address:
        return
    if not answers(address, GCS_PROBE_S):
        raise ConfigError(
            "RAY_ADDRESS",
            f"no Ray cluster answers at {address} (TCP, {GCS_PROBE_S:.0f} s): start its head with "
            "`ray start --head` (and the other nodes with `ray start --address=...`), or unset RAY_ADDRESS "
            "to start a private Ray",
        )


@contextlib.contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """``ray.init`` replaces the driver's SIGTERM handler (``sys.exit`` plus a C++ stack dump); keep
    the Python handlers the caller installed (``roll.pipeline.common.signals``)."""
    if threading.current_thread() is not threading.main_thread():
        # Off the main thread (``prestart``) Ray sets no handler, and says so; nothing to keep.
        ray_logger = logging.getLogger("ray._private.worker")
        ray_logger.addFilter(_no_sigterm_note)
        try:
            yield
        finally:
            ray_logger.removeFilter(_no_sigterm_note)
        return
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(signum, handler)


def reinstall_signal_handlers() -> None:
    """Put the Python handlers of SIGTERM/SIGINT back in front of the C-level ones Ray's core
    worker installs (a stack dump, then abort): needed in the main thread after a ``ray.init`` that
    ran on another thread, where ``keep_signal_handlers`` could not."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(signum)
        if handler is not None:
            signal.signal(signum, handler)


def _no_sigterm_note(record: logging.LogRecord) -> bool:
    return "SIGTERM handler is not set" not in record.getMessage()


def gcs_reachable(timeout_s: float = 2.0) -> bool:
    """Whether this driver's Ray GCS still accepts connections."""
    if not ray.is_initialized():
        return False
    return answers(ray.get_runtime_context().gcs_address, timeout_s)
