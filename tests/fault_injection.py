"""Fault injection for tests: worker classes that fail on purpose, and a launcher that runs with them.

``with_faults(worker_cls)`` subclasses a worker class so that every ``@register``-ed method first
reads ``ROLL_INJECT_FAULT=<role>:<rank>:<method>:<action>`` from the worker's environment (e.g. the
pipeline's ``system_envs``); the worker it names acts on its first call of ``method``:

- ``exit``: the process ends at once (``os._exit(1)``), like a crash or the OOM killer;
- ``hang``: the process stops itself with SIGSTOP, like a worker stuck in a driver or a collective;
- ``raise``: the method raises ``RuntimeError("injected fault ...")``.

Run as a script it is ``examples/start_rlvr_pipeline.py`` with every role's workers so wrapped::

    python tests/fault_injection.py --config_name my_run --config_path /tmp/cfg   # system_envs: {ROLL_INJECT_FAULT: "actor_train:1:train_step:exit"}
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "ROLL_INJECT_FAULT"
ACTIONS = ("exit", "hang", "raise")


@dataclass(frozen=True)
class Fault:
    role: str
    rank: int
    method: str
    action: str


def parse_fault(spec: str) -> Fault:
    """``"actor_train:1:train_step:exit"`` -> Fault; a ValueError naming the variable otherwise."""
    parts = spec.split(":")
    if len(parts) != 4 or not parts[1].isdigit() or parts[3] not in ACTIONS:
        raise ValueError(
            f"{ENV}={spec!r}: expected <role>:<rank>:<method>:<action> with action one of {list(ACTIONS)}"
        )
    return Fault(parts[0], int(parts[1]), parts[2], parts[3])


def inject_fault(worker: Any, method: str) -> None:
    """Act on the fault ``ROLL_INJECT_FAULT`` names when it is this worker's call (once per worker)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    fault = parse_fault(spec)
    fired = worker.__dict__.setdefault("_injected_faults", set())
    if (worker.role, worker.rank, method) != (fault.role, fault.rank, fault.method) or fault in fired:
        return
    fired.add(fault)
    if fault.action == "exit":
        os._exit(1)
    if fault.action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    raise RuntimeError(f"injected fault ({ENV}={spec})")


def with_faults(worker_cls: type) -> type:
    """``worker_cls`` with ``inject_fault`` before every method a Cluster can call."""
    from roll.distributed.executor.dispatch import dispatch_mode

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # keeps the @register mark
        def call(self, *args: Any, **kwargs: Any) -> Any:
            inject_fault(self, fn.__name__)
            return fn(self, *args, **kwargs)

        return call

    methods = {}
    for name in dir(worker_cls):
        fn = getattr(worker_cls, name)
        try:
            dispatch_mode(fn)
        except TypeError:
            continue
        methods[name] = wrap(fn)
    return type(f"Faulty{worker_cls.__name__}", (worker_cls,), methods)


def install() -> None:
    """Make the RLVR pipeline start every role with ``with_faults`` workers (in this process)."""
    import ray.cloudpickle

    from roll.pipeline.workers import classes

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    role_classes = classes.role_classes

    def faulty_role_classes(role: str):
        cluster_cls, worker_cls = role_classes(role)
        return cluster_cls, with_faults(worker_cls)

    classes.role_classes = faulty_role_classes


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fault_injection  # this file under its module name, so Ray can ship its functions

    fault_injection.install()
    from roll.launch.rlvr import main

    sys.exit(main())
