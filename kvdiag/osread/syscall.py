"""Syscall numbers per architecture, by meaning, futex constants, and the parser of a /proc/.../syscall line.

Nothing here reads: these are the kernel's ABI. The capture uses the host's row; the analyzers (which may
import this module and no other of kvdiag.osread) use the row of the machine a bundle was captured on.
"""

from __future__ import annotations

import platform

# meaning -> syscall numbers. read: the first argument is the fd read (read, pread64, readv, recvfrom, recvmsg,
# preadv, recvmmsg); write: the first argument is the fd written (write, pwrite64, writev, sendto, sendmsg,
# pwritev, sendmmsg); wait4 (first argument the pid) and waitid (second argument the id);
# epoll: epoll_wait/epoll_pwait (first argument the epoll fd, fourth the timeout);
# event: any wait for an event source (poll, select, epoll, accept, pause, signals, io_uring); sleep:
# nanosleep family; futex; yield: sched_yield; flock, fcntl (F_SETLKW waits for a record lock); open: open,
# openat, openat2 (the path is the first argument of open, the second of the others); restart: restart_syscall,
# where a timed wait (nanosleep, a futex wait with a timeout, poll/select with one) resumes after a stop (a
# debugger's attach, SIGSTOP/SIGCONT), with no argument saying which it was.
SYSCALLS: dict[str, dict[str, frozenset[int]]] = {
    "x86_64": {"read": frozenset({0, 17, 19, 45, 47, 295, 299}), "epoll": frozenset({232, 281}),
               "write": frozenset({1, 18, 20, 44, 46, 296, 307}), "wait4": frozenset({61}), "waitid": frozenset({247}),
               "event": frozenset({7, 23, 232, 281, 270, 271, 288, 43, 441, 34, 130, 128}),
               "sleep": frozenset({35, 230}), "futex": frozenset({202}), "yield": frozenset({24}),
               "flock": frozenset({73}), "fcntl": frozenset({72}), "open": frozenset({2, 257, 437}),
               "connect": frozenset({42}), "sigwait": frozenset({128}), "mq_receive": frozenset({243}),
               "restart": frozenset({219})},
    "aarch64": {"read": frozenset({63, 65, 67, 69, 207, 212, 243}), "epoll": frozenset({22}),
                "write": frozenset({64, 66, 68, 206, 211, 70, 269}), "wait4": frozenset({260}),
                "waitid": frozenset({95}),
                "event": frozenset({73, 72, 22, 242, 202, 133, 137, 441}),
                "sleep": frozenset({101, 115}), "futex": frozenset({98}), "yield": frozenset({124}),
                "flock": frozenset({32}), "fcntl": frozenset({25}), "open": frozenset({56, 437}),
                "connect": frozenset({203}), "sigwait": frozenset({137}), "mq_receive": frozenset({183}),
                "restart": frozenset({128})},
}
# poll/ppoll: nr -> index of the int timeout argument; -1 for ppoll, whose timeout is a pointer (NULL: forever).
POLL_TIMEOUT_ARG: dict[str, dict[int, int]] = {"x86_64": {7: 2, 271: -1}, "aarch64": {73: -1}}
# select/pselect6: nr -> what its timeout points to ("timeval" or "timespec"; NULL: forever). The read set is the
# second argument, a bitmap of the first argument's number of fds.
SELECT_TIMEOUT: dict[str, dict[int, str]] = {"x86_64": {23: "timeval", 270: "timespec"}, "aarch64": {72: "timespec"}}

HOST_MACHINE = platform.machine()
HOST_SYSCALLS: dict[str, frozenset[int]] = SYSCALLS.get(HOST_MACHINE, {})
HOST_POLL_TIMEOUT_ARG: dict[int, int] = POLL_TIMEOUT_ARG.get(HOST_MACHINE, {})
HOST_SELECT_TIMEOUT: dict[int, str] = SELECT_TIMEOUT.get(HOST_MACHINE, {})
FUTEX_SYSCALL_NR = min(HOST_SYSCALLS.get("futex", frozenset({202})))

# wchan of a task parked in futex(2): newer kernels say futex_do_wait, older ones futex_wait_queue /
# futex_wait_queue_me.
FUTEX_WCHANS = ("futex_wait_queue", "futex_do_wait", "futex_wait_queue_me", "futex_wait")
FUTEX_CMD_MASK = 0x7F           # strips FUTEX_PRIVATE_FLAG (128) and FUTEX_CLOCK_REALTIME (256)
FUTEX_WAIT = 0
FUTEX_PI_CMDS = frozenset({6, 11, 13})   # LOCK_PI, WAIT_REQUEUE_PI, LOCK_PI2: the word holds the owner TID
FUTEX_TID_MASK = 0x3FFFFFFF
# fcntl commands that wait for a record lock: F_SETLKW, F_OFD_SETLKW.
FCNTL_WAIT_CMDS = frozenset({7, 38})


def syscalls_of(machine: str | None) -> dict[str, frozenset[int]]:
    """The table of ``machine`` (x86_64's when unknown, as bundles without a machine came from x86_64)."""
    return SYSCALLS.get(machine or "x86_64", SYSCALLS["x86_64"])


def parse_syscall(raw: str | None) -> tuple[int | None, list[int]]:
    """``202 0x7f.. 0x189 ...`` → (202, [args]); ``running`` / ``-1 sp pc`` → (None or -1, [])."""
    if not raw:
        return None, []
    parts = raw.split()
    try:
        nr = int(parts[0])
    except ValueError:
        return None, []
    if nr < 0:
        return nr, []
    args: list[int] = []
    for p in parts[1:7]:
        try:
            args.append(int(p, 16))
        except ValueError:
            break
    return nr, args


def futex_wait_of(raw: str | None) -> tuple[int, int] | None:
    """(address, command) when the syscall line is a futex call on this host."""
    nr, args = parse_syscall(raw)
    if nr != FUTEX_SYSCALL_NR or len(args) < 2:
        return None
    return args[0], args[1] & FUTEX_CMD_MASK


def int_timeout(register: int) -> int:
    """An ``int timeout`` argument as the register holds it: negative (wait forever) becomes -1."""
    t = register & 0xFFFFFFFF
    return -1 if t >= 1 << 31 else t
