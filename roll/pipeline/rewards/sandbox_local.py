"""The ``unsafe_local`` backend: a plain subprocess with rlimits and a Python audit hook, NOT a sandbox.

This is how roll ran candidate programs before 2026-11-27, kept for machines that cannot make
namespaces and for the throughput baseline (benchmarks/sandbox_throughput.py). Python's audit
hooks are not a security boundary: a program can start processes past them (e.g. through
``_posixsubprocess.fork_exec``) and read every file the host user can. Choosing it logs a warning.

What it does: a fresh temp dir as cwd, HOME and TMPDIR, removed afterwards; rlimits (CPU seconds,
address space, output file size, open files, no core dumps); a new session whose process group is
SIGKILLed at the end; an audit hook that refuses the usual process, socket, ctypes and file-change
events; an empty environment and ``python -I``.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from roll.pipeline.rewards.sandbox_config import SandboxConfig
from roll.pipeline.rewards.sandbox_types import Limits, SandboxResult

logger = logging.getLogger(__name__)
WARNING = (
    "code sandbox backend unsafe_local: candidate programs run WITHOUT isolation, with the "
    "permissions of this process (an audit hook is not a sandbox); use bubblewrap or sandbox_fusion"
)

# Installed in the child before the candidate program runs; ``__SANDBOX__`` is replaced by the
# temp dir. It refuses every event in BLOCKED and file changes outside the temp dir.
_GUARD = r"""
import os, sys
_ROOT = os.path.realpath(__SANDBOX__)
_BLOCKED = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
            "subprocess.Popen", "socket.", "ctypes.", "os.kill", "os.killpg", "signal.pthread_kill",
            "resource.setrlimit", "sys.addaudithook", "os.chdir", "os.chroot", "pty.")
_PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree")
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == _ROOT or real.startswith(_ROOT + os.sep)

def _guard(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args[0] is not None:
        mode, flags = args[1] or "", args[2] or 0
        writes = any(c in str(mode) for c in "wax+") or flags & _WRITE
        if writes and not _inside(args[0]):
            raise PermissionError("sandbox: writing outside the temp dir is not allowed")
    elif event in _PATH_EVENTS and not all(_inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
        raise PermissionError(f"sandbox: {event} outside the temp dir is not allowed")

sys.addaudithook(_guard)
del _guard
sys.argv = ["solution.py"]
_code = open(os.path.join(_ROOT, "solution.py")).read()
exec(compile(_code, "solution.py", "exec"), {"__name__": "__main__"})
"""


class UnsafeLocalSandbox:
    def __init__(self, config: SandboxConfig | None = None):
        logger.warning(WARNING)

    @staticmethod
    def unavailable_reason() -> None:
        logger.warning(WARNING)  # it always runs; say so before launch too
        return None

    def run(self, code: str, stdin: str, limits: Limits) -> SandboxResult:
        return run_unsafe_local(code, stdin, limits.time_limit_s, limits.memory_mb, limits.output_bytes)


def _limits(cpu_s: int, memory_mb: int, output_bytes: int) -> None:
    """Runs in the child between fork and exec."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_unsafe_local(
    code: str,
    stdin: str = "",
    time_limit_s: float = 2.0,
    memory_mb: int = 512,
    output_bytes: int = 1 << 20,
) -> SandboxResult:
    """Run ``code`` with ``stdin``; return its exit code and (at most ``output_bytes`` of) stdout."""
    with tempfile.TemporaryDirectory(prefix="roll-sandbox-") as tmp:
        root = Path(tmp)
        (root / "solution.py").write_text(code)
        (root / "guard.py").write_text(_GUARD.replace("__SANDBOX__", repr(str(root))))
        (root / "stdin.txt").write_text(stdin)
        start = time.monotonic()
        with open(root / "stdin.txt", "rb") as fin, open(root / "stdout.txt", "wb") as fout:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(root / "guard.py")],
                cwd=tmp,
                stdin=fin,
                stdout=fout,
                stderr=subprocess.DEVNULL,
                env={"HOME": tmp, "TMPDIR": tmp, "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
                start_new_session=True,
                preexec_fn=lambda: _limits(int(time_limit_s) + 1, memory_mb, output_bytes),
            )
            timed_out = False
            try:
                proc.wait(timeout=time_limit_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
        stdout = (root / "stdout.txt").read_bytes()[:output_bytes].decode("utf-8", "replace")
        code_out = None if timed_out else proc.returncode
        return SandboxResult(code_out, stdout, timed_out, time.monotonic() - start)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
