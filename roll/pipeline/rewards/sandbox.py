"""Run an untrusted Python program with stdin and get its exit code and stdout, on a sandbox backend.

    result = run_sandboxed("print(input()[::-1])", stdin="abc")
    result.ok, result.stdout        # True, 'cba\\n'

    sandbox = get_sandbox(SandboxConfig(backend="sandbox_fusion", url="http://127.0.0.1:8080"))
    sandbox.run(code, stdin, Limits(time_limit_s=2.0))

Backends (``SANDBOX_BACKENDS``, chosen by ``SandboxConfig.backend``):

- ``bubblewrap`` (default): each program in its own user, mount, pid, network, ipc and uts
  namespaces made by bubblewrap, seeing only a read-only view of the Python interpreter, its
  standard library and the shared libraries, with a private size-bounded /tmp; a seccomp filter;
  rlimits; every process killed at the end (``roll.pipeline.rewards.sandbox_bwrap``). If the
  machine cannot make the namespaces, it refuses to start with the reason.
- ``sandbox_fusion``: a SandboxFusion service's ``POST /run_code``; the service does the isolation
  (``roll.pipeline.rewards.sandbox_fusion``).
- ``unsafe_local``: a plain subprocess with rlimits and a Python audit hook, as roll ran before
  2026-11-27. Audit hooks are not a security boundary (a program can start processes and read every
  file the host user can); it logs a warning (``roll.pipeline.rewards.sandbox_local``).

A failure of the sandbox itself (bubblewrap missing or failing to set up, the service unreachable
or answering with an error) raises ``SandboxError``: the reward counts it as a failure, not as a
wrong program.
"""

from __future__ import annotations

import functools
import importlib

from roll.pipeline.rewards.sandbox_config import SANDBOX_BACKENDS, SandboxConfig
from roll.pipeline.rewards.sandbox_types import Limits, Sandbox, SandboxError, SandboxResult

__all__ = [
    "Limits",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxResult",
    "backend_class",
    "get_sandbox",
    "run_sandboxed",
]


def backend_class(name: str) -> type[Sandbox]:
    """The class registered as ``name`` in SANDBOX_BACKENDS (imported now)."""
    module_name, _, class_name = SANDBOX_BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


@functools.cache
def get_sandbox(config: SandboxConfig) -> Sandbox:
    """The backend for ``config``, made once per process (raises SandboxError if it cannot work)."""
    return backend_class(config.backend)(config)


def run_sandboxed(
    code: str,
    stdin: str = "",
    time_limit_s: float = 2.0,
    memory_mb: int = 512,
    output_bytes: int = 1 << 20,
    config: SandboxConfig = SandboxConfig(),
) -> SandboxResult:
    """Run ``code`` with ``stdin`` on ``config``'s backend (bubblewrap by default)."""
    return get_sandbox(config).run(code, stdin, Limits(time_limit_s, memory_mb, output_bytes))
