"""The bubblewrap backend: each candidate program in a fresh set of Linux namespaces.

    sandbox = BubblewrapSandbox(SandboxConfig())          # SandboxUnavailable if the host cannot
    sandbox.run("print(int(input()) * 2)", "21", Limits())  # SandboxResult(0, '42\\n', ...)

What each program gets, enforced by the kernel (bubblewrap sets it up, then execs the interpreter):

- its own user, mount, pid, network, ipc, uts (and, where the kernel has it, cgroup) namespaces;
  nested user namespaces are disabled (``--disable-userns``); the program runs as uid/gid 65534
  with no capabilities;
- a file system made of read-only binds of the Python interpreter, its standard library (its
  site-packages hidden under an empty read-only mount) and the shared library directories
  (/usr/lib, /lib, /lib64 ...), a minimal /dev, and a private tmpfs /tmp of ``TMP_BYTES`` as cwd
  and HOME, holding the program; / and /dev are read-only. No /etc, /home, /root beyond the
  interpreter, no /proc, nothing of the run's output_dir or the working directory;
- no network: the new network namespace has only a loopback that is down;
- the seccomp filter of ``roll.pipeline.rewards.sandbox_seccomp`` (no new processes, no
  ptrace, mount, namespaces, kexec, bpf, keyctl, sockets but AF_UNIX ...);
- rlimits set before the program runs: CPU seconds, address space, file size (stdout included),
  open files, processes/threads, no core dumps; an empty environment and ``python -I -S``;
- an end: at the wall-clock limit the pid namespace's init is SIGKILLed through a pidfd (the kernel
  kills and reaps every process of the namespace before init is gone), then the process group;
  ``run`` returns only once nothing of the sandbox is left. ``--die-with-parent`` does the same
  when the scoring process dies.

A host where bubblewrap, libseccomp or user namespaces are missing gets ``SandboxUnavailable``
with the reason and how to enable it (``unavailable_reason``).
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import time

from roll.pipeline.rewards.sandbox_config import SandboxConfig
from roll.pipeline.rewards.sandbox_seccomp import SeccompUnavailable, seccomp_filter
from roll.pipeline.rewards.sandbox_types import Limits, SandboxError, SandboxResult

TMP_BYTES = 32 << 20  # the private /tmp (tmpfs pages are host memory, outside RLIMIT_AS)
MAX_OPEN_FILES = 64
MAX_THREADS = 64  # RLIMIT_NPROC inside the sandbox's own user namespace (not enforced for host root)
SANDBOX_UID = "65534"
INFO_TIMEOUT_S = 30.0  # bwrap's start, and the namespace's teardown after SIGKILL
LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
# Written to stderr by the guard before the program runs: its absence means bubblewrap itself failed.
STARTED = b"roll-sandbox-started\n"
ENABLE_HINT = (
    "enable unprivileged user namespaces (sysctl -w kernel.unprivileged_userns_clone=1 "
    "user.max_user_namespaces=28633; on Ubuntu 24.04+ also kernel.apparmor_restrict_unprivileged_userns=0), "
    "or set the reward's sandbox: {backend: unsafe_local} to run programs without isolation"
)

# Run by ``python -I -S -c`` inside the sandbox: the rlimits, then the program as ``__main__``.
_GUARD = """\
import os, resource, sys
os.write(2, {started!r})
for _limit, _value in {limits!r}:
    resource.setrlimit(_limit, (_value, _value))
del os, resource, _limit, _value
sys.argv = ["solution.py"]
with open("/tmp/solution.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "solution.py", "exec")
del _f
exec(_code, {{"__name__": "__main__", "__builtins__": __builtins__}})
"""


class SandboxUnavailable(SandboxError):
    """This machine cannot make the sandbox; the message says what is missing."""


class BubblewrapSandbox:
    def __init__(self, config: SandboxConfig | None = None):
        reason = unavailable_reason()
        if reason is not None:
            raise SandboxUnavailable(reason)
        self.bwrap = shutil.which("bwrap") or "/usr/bin/bwrap"
        self.filter = seccomp_filter()
        self.exe, self.view = interpreter_view()

    @staticmethod
    def unavailable_reason() -> str | None:
        return unavailable_reason()

    def run(self, code: str, stdin: str, limits: Limits) -> SandboxResult:
        info_read, info_write = os.pipe()  # bwrap writes {"child-pid": ...} of the namespace's init
        fds = [_memfd("solution.py", code.encode()), _memfd("seccomp", self.filter), info_write]
        stdin_fd, stdout_fd, stderr_fd = _memfd("stdin", stdin.encode()), _memfd("stdout"), _memfd("stderr")
        try:
            start = time.monotonic()
            proc = subprocess.Popen(
                self.command(*fds, limits),
                stdin=stdin_fd,
                stdout=stdout_fd,
                stderr=stderr_fd,
                env={},
                pass_fds=fds,
                start_new_session=True,
            )
            os.close(fds.pop())
            timed_out = _wait(proc, _init_pidfd(info_read), limits.time_limit_s)
            seconds = time.monotonic() - start
            if not os.pread(stderr_fd, len(STARTED), 0) == STARTED:
                error = os.pread(stderr_fd, 500, 0).decode("utf-8", "replace").strip().splitlines()
                raise SandboxError(
                    f"bubblewrap failed to start the program: {error[0] if error else proc.returncode}"
                )
            stdout = os.pread(stdout_fd, limits.output_bytes, 0).decode("utf-8", "replace")
            return SandboxResult(None if timed_out else proc.returncode, stdout, timed_out, seconds)
        finally:
            for fd in (*fds, info_read, stdin_fd, stdout_fd, stderr_fd):
                os.close(fd)

    def command(self, code_fd: int, filter_fd: int, info_fd: int, limits: Limits) -> list[str]:
        cpu_s = int(limits.time_limit_s) + 1
        rlimits = [
            (RLIMIT["CPU"], cpu_s),
            (RLIMIT["AS"], limits.memory_mb << 20),
            (RLIMIT["FSIZE"], limits.output_bytes),
            (RLIMIT["NOFILE"], MAX_OPEN_FILES),
            (RLIMIT["NPROC"], MAX_THREADS),
            (RLIMIT["CORE"], 0),
        ]
        guard = _GUARD.format(started=STARTED, limits=rlimits)
        return [
            self.bwrap,
            *("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"),
            *("--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--clearenv"),
            *("--uid", SANDBOX_UID, "--gid", SANDBOX_UID, "--hostname", "sandbox"),
            *("--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp"),
            *self.view,
            *("--dev", "/dev", "--size", str(TMP_BYTES), "--tmpfs", "/tmp"),
            *("--file", str(code_fd), "/tmp/solution.py"),
            *("--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"),
            *("--seccomp", str(filter_fd), "--info-fd", str(info_fd)),
            *("--", self.exe, "-I", "-S", "-c", guard),
        ]


RLIMIT = {
    name: getattr(__import__("resource"), f"RLIMIT_{name}")
    for name in ("CPU", "AS", "FSIZE", "NOFILE", "NPROC", "CORE")
}


def _init_pidfd(info_read: int) -> int | None:
    """A pidfd of the pid namespace's init, from bwrap's info JSON (None: bwrap failed before it)."""
    data = b""
    while b"}" not in data and select.select([info_read], [], [], INFO_TIMEOUT_S)[0]:
        chunk = os.read(info_read, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return os.pidfd_open(json.loads(data)["child-pid"])
    except (ValueError, KeyError, OSError):
        return None


def _wait(proc: subprocess.Popen, init: int | None, time_limit_s: float) -> bool:
    """Wait up to the limit, then SIGKILL the namespace's init (the kernel kills and reaps every
    process of the namespace before init is gone, and bwrap exits after it), then the process
    group as a backstop. Returns whether the limit was hit; on return no sandbox process is left."""
    timed_out = False
    try:
        proc.wait(timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if init is not None:
            try:
                signal.pidfd_send_signal(init, signal.SIGKILL)
            except ProcessLookupError:
                pass
            select.select([init], [], [], INFO_TIMEOUT_S)  # readable once init has exited
            os.close(init)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    return timed_out


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(f"roll-sandbox-{name}", 0)  # not inherited: passed by stdin/pass_fds only
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.cache
def interpreter_view() -> tuple[str, list[str]]:
    """The interpreter to run and the bwrap arguments of the read-only file system around it."""
    exe = os.path.realpath(sys.executable)  # a virtualenv's python links to the base interpreter
    args: list[str] = []
    bound: list[str] = []
    for path in LIBRARY_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
            bound.append(path)
    lib_dirs = (
        sysconfig.get_config_var("LIBDIR"),
        sysconfig.get_path("stdlib"),
        sysconfig.get_path("platstdlib"),
    )
    for path in (exe, *lib_dirs):
        if path and os.path.exists(path) and not _under(path, bound):
            args += ["--ro-bind", path, path]
            bound.append(path)
    for packages in site.getsitepackages([sys.base_prefix]):
        if os.path.isdir(packages) and _under(packages, bound):
            args += ["--tmpfs", packages, "--remount-ro", packages]
    return exe, args


def _under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


@functools.cache
def unavailable_reason() -> str | None:
    """None when the sandbox works here, else one line: what is missing and how to get it."""
    if sys.platform != "linux":
        return f"the bubblewrap sandbox needs Linux, this is {sys.platform}"
    if shutil.which("bwrap") is None and not os.path.exists("/usr/bin/bwrap"):
        return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap (dnf install bubblewrap)"
    try:
        seccomp_filter()
    except (SeccompUnavailable, OSError) as exc:
        return f"cannot build the sandbox's seccomp filter: {exc}"
    return _probe()


def _probe() -> str | None:
    sandbox = object.__new__(BubblewrapSandbox)
    sandbox.bwrap = shutil.which("bwrap") or "/usr/bin/bwrap"
    sandbox.filter = seccomp_filter()
    sandbox.exe, sandbox.view = interpreter_view()
    try:
        result = sandbox.run("print(6 * 7)", "", Limits(time_limit_s=30.0))
    except SandboxError as exc:
        return f"bubblewrap cannot make the sandbox here ({str(exc).split(': ', 1)[-1]}): {ENABLE_HINT}"
    if result.stdout != "42\n":
        return (
            f"a test program in the bubblewrap sandbox failed (exit code {result.returncode}): {ENABLE_HINT}"
        )
    return None
