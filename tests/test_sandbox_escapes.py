"""Candidate programs that try to escape the bubblewrap code sandbox, one per way out; each must fail,
and a normal program must still pass in the same sandbox afterwards.

Skips only off CI when this machine cannot make the sandbox; with CI=true a missing bubblewrap fails
(.ci/run installs it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from roll.pipeline.rewards.code_sandbox import code_sandbox_reward
from roll.pipeline.rewards.sandbox import Limits, SandboxConfig, SandboxResult, get_sandbox
from roll.pipeline.rewards.sandbox_bwrap import unavailable_reason

REASON = unavailable_reason()
if REASON is not None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the sandbox escape tests: {REASON}", pytrace=False)
    pytest.skip(REASON, allow_module_level=True)

SANDBOX = get_sandbox(SandboxConfig())
UNSAFE = get_sandbox(SandboxConfig(backend="unsafe_local"))
FAST = Limits(time_limit_s=3.0)

# _posixsubprocess.fork_exec called directly (no audit event), with the arity of this Python's
# version (pgid_to_set and allow_vfork came and go); a wrong arity is a TypeError before any fork.
FORK_EXEC = """\
import _posixsubprocess, os
r, w = os.pipe()
head = [[b"/bin/echo"], [b"/bin/echo"], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, True, False]
for pgid, vfork in (([-1], [True]), ([-1], []), ([], [])):
    try:
        pid = _posixsubprocess.fork_exec(*head, *pgid, None, None, None, -1, None, *vfork)
        break
    except TypeError:
        continue
os.waitpid(pid, 0)
print("started", pid)
"""


def run(code: str, stdin: str = "", limits: Limits = FAST) -> SandboxResult:
    return SANDBOX.run(code, stdin, limits)


def assert_normal_program_passes() -> None:
    result = run("import os\nopen('a.txt', 'w').write(input())\nprint(int(open('a.txt').read()) * 2)", "21")
    assert result.ok and result.stdout == "42\n", result


def host_processes_named(comm: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == comm:
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def test_fork_exec_through_posixsubprocess_starts_nothing():
    assert "started" in UNSAFE.run(FORK_EXEC, "", FAST).stdout  # the hole of the audit-hook sandbox
    result = run(FORK_EXEC)
    assert not result.ok and "started" not in result.stdout
    assert_normal_program_passes()


def test_libc_fork_through_ctypes_fails():
    result = run("import ctypes\nprint('fork returned', ctypes.CDLL(None).fork())")
    assert result.stdout == "fork returned -1\n"  # in the parent: no child was made
    assert_normal_program_passes()


def test_etc_passwd_and_the_host_tree_are_not_there():
    result = run("print(open('/etc/passwd').read())")
    assert not result.ok and result.stdout == ""
    listing = run("import os\nprint(sorted(os.listdir('/')))")
    top = set(json.loads(listing.stdout.replace("'", '"')))
    assert {"dev", "tmp", "usr"} <= top <= {"dev", "lib", "lib64", "lib32", "root", "tmp", "usr"}, top
    assert_normal_program_passes()


def test_the_runs_output_dir_cannot_be_read(tmp_path, monkeypatch):
    output_dir = tmp_path / "output_dir"
    output_dir.mkdir()
    (output_dir / "secret.txt").write_text("hunter2")
    monkeypatch.chdir(output_dir)  # as a reward worker whose cwd is the run's output_dir
    truth = json.dumps([{"input": "", "output": "hunter2"}])
    for path in (str(output_dir / "secret.txt"), "secret.txt", "../output_dir/secret.txt"):
        assert code_sandbox_reward(f"print(open({path!r}).read())", truth) == 0.0, path
    assert code_sandbox_reward("print('hunter2')", truth) == 1.0
    assert_normal_program_passes()


def test_writes_outside_the_temp_dir_fail_and_reach_nothing(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    for target in (str(victim), "/usr/lib/planted.txt", "/planted.txt", "/dev/planted", "/root/planted"):
        result = run(f"open({target!r}, 'w').write('gone')\nprint('wrote')")
        assert not result.ok and "wrote" not in result.stdout, target
    assert victim.read_text() == "keep"
    assert_normal_program_passes()


def test_no_network_not_even_to_localhost():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0roll-sandbox-test-%d" % os.getpid())
    abstract.listen()
    abstract.setblocking(False)
    port = listener.getsockname()[1]
    try:
        for code in (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')",
            f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect(b'\\0roll-sandbox-test-{os.getpid()}')\n"
            "print('connected')",
        ):
            result = run(code)
            assert not result.ok and "connected" not in result.stdout, code
        for server in (listener, abstract):
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        listener.close()
        abstract.close()
    assert_normal_program_passes()


def test_fork_bomb_and_thread_bomb_end_bounded():
    start = time.monotonic()
    assert not run("import os\nwhile True:\n    os.fork()").ok
    threads = (
        "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()"
    )
    assert not run(threads).ok
    assert time.monotonic() - start < 2 * FAST.time_limit_s + 2
    assert_normal_program_passes()


def test_ten_gigabytes_fail_by_rlimit():
    start = time.monotonic()
    result = run("x = bytearray(10 << 30)\nprint('allocated')")
    assert not result.ok and not result.timed_out and "allocated" not in result.stdout
    assert time.monotonic() - start < FAST.time_limit_s
    assert_normal_program_passes()


def test_infinite_loop_is_killed_at_the_time_limit_and_leaves_no_process():
    comm = f"rollspin{os.getpid() % 100000}"
    code = f"import ctypes\nctypes.CDLL(None).prctl(15, {comm.encode()!r})\nwhile True:\n    pass"
    seen: list[int] = []

    def watch() -> None:
        while not seen and not done.is_set():
            seen.extend(host_processes_named(comm))
            time.sleep(0.05)

    done = threading.Event()
    watcher = threading.Thread(target=watch)
    watcher.start()
    result = run(code, limits=Limits(time_limit_s=1.5))
    done.set()
    watcher.join()
    assert result.timed_out and result.seconds < 3
    assert seen, "the spinning program was never seen on the host: this test would prove nothing"
    assert host_processes_named(comm) == []
    assert_normal_program_passes()


def test_killing_the_parent_and_everyone_harms_nothing_outside():
    canary = subprocess.Popen(["sleep", "30"])
    try:
        code = (
            "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
            "try:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    print('nothing to kill')\n"
            "print('alive')"
        )
        result = run(code)
        # Its parent is the pid namespace's init (immune to SIGKILL from inside); -1 finds no one.
        assert result.stdout == "nothing to kill\nalive\n"
        assert canary.poll() is None
    finally:
        canary.kill()
        canary.wait()
    assert_normal_program_passes()
