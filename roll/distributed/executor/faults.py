"""Fault injection into workers, to test how a run ends when a worker dies or hangs.

Set ``ROLL_INJECT_FAULT`` in the workers' environment (e.g. the pipeline's ``system_envs``) to
``<role>:<rank>:<method>:<action>``; that worker then acts on its first call of ``method`` (any
method marked with ``@register``), before running it:

- ``exit``: the process ends at once (``os._exit(1)``), like a crash or the OOM killer;
- ``hang``: the process stops itself with SIGSTOP, like a worker stuck in a driver or a collective;
- ``raise``: the method raises ``RuntimeError("injected fault ...")``.

    system_envs: {ROLL_INJECT_FAULT: "actor_train:1:train_step:exit"}
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

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


_fired: set[Fault] = set()


def inject_fault(worker: object, method: str) -> None:
    """Act on the fault ``ROLL_INJECT_FAULT`` names when it is this worker's call (once per process)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    fault = parse_fault(spec)
    where = (getattr(worker, "role", None), getattr(worker, "rank", None), method)
    if where != (fault.role, fault.rank, fault.method) or fault in _fired:
        return
    _fired.add(fault)
    if fault.action == "exit":
        os._exit(1)
    if fault.action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    raise RuntimeError(f"injected fault ({ENV}={spec})")
