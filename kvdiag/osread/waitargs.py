"""What a blocked syscall waits on beyond a read: the fd of a write/send, the pid of a wait4/waitid.

Pure decoding of a /proc/PID/task/TID/syscall line with :mod:`kvdiag.osread.syscall`'s tables. No policy."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.osread.syscall import HOST_MACHINE, parse_syscall, syscalls_of

_P_PID = 1


@dataclass(frozen=True)
class BlockedCall:
    op: str               # "write" (write/send family) or "wait" (wait4/waitid)
    fd: int | None = None
    pid: int | None = None   # wait: the child waited for; -1 any child (or a process group)


def _signed(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def blocked_call(raw: str | None, machine: str | None = None) -> BlockedCall | None:
    """The write or wait a thread is blocked in, from its raw syscall line; None for anything else."""
    if not raw:
        return None
    nr, args = parse_syscall(raw)
    if nr is None or nr < 0 or not args:
        return None
    table = syscalls_of(machine or HOST_MACHINE)
    if nr in table["write"]:
        return BlockedCall(op="write", fd=_signed(args[0]))
    if nr in table["wait4"]:
        pid = _signed(args[0])
        return BlockedCall(op="wait", pid=pid if pid > 0 else -1)
    if nr in table["waitid"] and len(args) > 1:
        return BlockedCall(op="wait", pid=_signed(args[1]) if args[0] == _P_PID else -1)
    return None
