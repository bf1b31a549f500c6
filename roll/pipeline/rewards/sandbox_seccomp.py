"""The seccomp filter of the bubblewrap sandbox, compiled with libseccomp (through ctypes).

    bpf = seccomp_filter()      # bytes of a classic BPF program, for ``bwrap --seccomp FD``

Default: allow; the calls below fail with EPERM (clone3 with ENOSYS, so libc falls back to clone,
whose flags a filter can read). Syscalls of any other architecture (i386 ``int 0x80``, x32) kill
the process (libseccomp's default for a foreign architecture).

- new processes: fork, vfork, and clone without CLONE_THREAD (threads are allowed) or with any
  CLONE_NEW* flag; process_vm_readv/writev, ptrace, kcmp, pidfd_getfd, perf_event_open;
- namespaces and mounts: unshare, setns, mount, umount2, pivot_root, chroot and the new mount API;
- the kernel: kexec_load, kexec_file_load, init/finit/delete_module, bpf, userfaultfd, io_uring_*,
  keyctl, add_key, request_key, reboot, swapon/off, acct, syslog, quotactl, iopl, ioperm, the
  clocks (settimeofday, clock_settime, clock_adjtime, adjtimex), open_by_handle_at;
- network: socket() of any family but AF_UNIX (the sandbox's network namespace has no interface
  up anyway); ioctl TIOCSTI / TIOCLINUX (typing into a terminal).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

DENIED = (
    "fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "perf_event_open", "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "bpf",
    "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key",
    "request_key", "reboot", "swapon", "swapoff", "acct", "syslog", "quotactl", "iopl", "ioperm",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "open_by_handle_at",
    "name_to_handle_at", "uselib", "vhangup", "lookup_dcookie",
)  # fmt: skip
CLONE_THREAD = 0x00010000
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)
AF_UNIX = 1
TERMINAL_IOCTLS = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class SeccompUnavailable(RuntimeError):
    pass


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        raise SeccompUnavailable("libseccomp is not installed (apt-get install libseccomp2)")
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)
    ]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


@functools.cache
def seccomp_filter() -> bytes:
    """The filter as BPF bytes (built once per process; raises SeccompUnavailable)."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        _add_rules(lib, ctx)
        read_fd, write_fd = os.pipe()
        try:
            if lib.seccomp_export_bpf(ctx, write_fd) != 0:
                raise SeccompUnavailable("seccomp_export_bpf failed")
            os.close(write_fd)
            write_fd = -1
            return _read_all(read_fd)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
    finally:
        lib.seccomp_release(ctx)


def _add_rules(lib: ctypes.CDLL, ctx: int) -> None:
    eperm = _errno_action(errno.EPERM)
    for name in DENIED:
        _rule(lib, ctx, eperm, name)
    _rule(lib, ctx, _errno_action(errno.ENOSYS), "clone3")
    # clone(flags, ...): flags is argument 0 on x86_64 and aarch64.
    _rule(lib, ctx, eperm, "clone", (0, SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0))
    for flag in CLONE_NEW:
        _rule(lib, ctx, eperm, "clone", (0, SCMP_CMP_MASKED_EQ, flag, flag))
    _rule(lib, ctx, eperm, "socket", (0, SCMP_CMP_NE, AF_UNIX, 0))
    for request in TERMINAL_IOCTLS:
        _rule(lib, ctx, eperm, "ioctl", (1, SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, request))


def _rule(lib: ctypes.CDLL, ctx: int, action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr < 0:
        return  # not a syscall of this architecture (fork and vfork on aarch64)
    array = (_ArgCmp * max(1, len(cmps)))(*(_ArgCmp(*cmp) for cmp in cmps))
    rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
    if rc != 0:
        raise SeccompUnavailable(f"libseccomp refused the rule for {name}: {os.strerror(-rc)}")


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)
