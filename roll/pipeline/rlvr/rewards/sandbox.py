"""Run an untrusted Python program in a throw-away subprocess that cannot harm the host.

    result = run_sandboxed("print(input()[::-1])", stdin="abc")
    result.ok, result.stdout        # True, 'cba\\n'

Layers, each a backstop for the others:
- a fresh temp dir as cwd, HOME and TMPDIR, removed afterwards; stdin/stdout are files in it;
- rlimits: CPU seconds, address space (memory), output file size (huge output is cut by SIGXFSZ),
  open files, and no core dumps;
- a new session, so the whole process group is SIGKILLed when the program ends or runs out of time;
- a Python audit hook installed before the program runs that refuses new processes (fork, exec,
  spawn, subprocess, os.system), sockets, ctypes, and any write, rename or delete outside the temp
  dir; audit hooks cannot be removed from Python code;
- an empty environment and ``python -I`` (no user site, no PYTHON* variables).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None: killed for time
    stdout: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _limits(cpu_s: int, memory_mb: int, output_bytes: int) -> None:
    """Runs in the child between fork and exec."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_sandboxed(
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
