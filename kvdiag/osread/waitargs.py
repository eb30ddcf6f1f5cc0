"""What a blocked syscall waits on beyond a read: the fd of a write/send, the pid of a wait4/waitid.

Pure decoding of a /proc/PID/task/TID/syscall line (``nr arg0 arg1 ...`` in hex). No policy."""

from __future__ import annotations

import platform
from dataclasses import dataclass

_MACHINE = platform.machine()
_WRITE_NRS = {"x86_64": {1, 18, 20, 44, 46, 296, 307}, "aarch64": {64, 66, 68, 206, 211, 70, 269}}
_WAIT4_NRS = {"x86_64": {61}, "aarch64": {260}}
_WAITID_NRS = {"x86_64": {247}, "aarch64": {95}}
_P_ALL, _P_PID = 0, 1


@dataclass(frozen=True)
class BlockedCall:
    op: str               # "write" (write/send family) or "wait" (wait4/waitid)
    fd: int | None = None
    pid: int | None = None   # wait: the child waited for; -1 any child (or a process group)


def _args(raw: str) -> tuple[int | None, list[int]]:
    parts = raw.split()
    try:
        nr = int(parts[0])
    except (ValueError, IndexError):
        return None, []
    args: list[int] = []
    for p in parts[1:7]:
        try:
            args.append(int(p, 16))
        except ValueError:
            break
    return nr, args


def _signed(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def blocked_call(raw: str | None, machine: str | None = None) -> BlockedCall | None:
    """The write or wait a thread is blocked in, from its raw syscall line; None for anything else."""
    if not raw:
        return None
    nr, args = _args(raw)
    if nr is None or nr < 0 or not args:
        return None
    arch = machine or _MACHINE
    if nr in _WRITE_NRS.get(arch, set()):
        return BlockedCall(op="write", fd=_signed(args[0]))
    if nr in _WAIT4_NRS.get(arch, set()):
        pid = _signed(args[0])
        return BlockedCall(op="wait", pid=pid if pid > 0 else -1)
    if nr in _WAITID_NRS.get(arch, set()) and len(args) > 1:
        return BlockedCall(op="wait", pid=_signed(args[1]) if args[0] == _P_PID else -1)
    return None
