"""Waits the kernel can name the other party of, beyond reads and futexes: a file lock (flock(2), a POSIX or
OFD record lock through fcntl(F_SETLKW)) whose holder /proc/locks names, and the open(2) of a FIFO, which
blocks until some process opens the other end (who holds the FIFO open, or nobody).

Read inside the progress window from the first sample's syscall lines; nothing here stops the target.
"""

from __future__ import annotations

import os
import stat

from kvdiag.model.evidence import KernelWait
from kvdiag.osread.fds import fd_stat, readlink, scan_holders
from kvdiag.osread.files import PROC
from kvdiag.osread.locks import FileLock, read_locks
from kvdiag.osread.mem import TargetMemory
from kvdiag.osread.syscall import FCNTL_WAIT_CMDS, HOST_SYSCALLS, parse_syscall

_AT_FDCWD = -100
_MAX_PATH = 512


def _dev(st: os.stat_result) -> tuple[int, int, int]:
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def _lock_wait(pid: int, tid: int, fd: int, what: str, locks: list[FileLock] | None) -> KernelWait:
    st = fd_stat(pid, fd)
    path = readlink(pid, fd)
    if st is None:
        return KernelWait(what=what, path=path)
    major, minor, ino = _dev(st)
    kinds = ("FLOCK",) if what == "flock" else ("POSIX", "OFDLCK")
    holders = None if locks is None else sorted({
        lk.pid for lk in locks if not lk.waiting and lk.kind in kinds and lk.same_file(major, minor, ino)
        and lk.pid is not None and lk.pid != pid})
    return KernelWait(what=what, path=path, file=f"{major:02x}:{minor:02x}:{ino}",
                      holder_pids=holders)


def _c_string(mem: TargetMemory, addr: int) -> str | None:
    raw = mem.read_upto(addr, _MAX_PATH)
    if not raw:
        return None
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace") or None


def _fifo_wait(pid: int, path: str, flags: int, dirfd: int, deadline: float | None) -> KernelWait | None:
    if not path.startswith("/"):
        base = readlink(pid, dirfd) if dirfd != _AT_FDCWD and dirfd >= 0 else os.readlink(f"{PROC}/{pid}/cwd") \
            if os.path.exists(f"{PROC}/{pid}/cwd") else None
        if base is None:
            return None
        path = os.path.join(base, path)
    try:
        st = os.stat(f"{PROC}/{pid}/root{path}") if os.path.exists(f"{PROC}/{pid}/root") else os.stat(path)
    except OSError:
        try:
            st = os.stat(path)
        except OSError:
            return None
    if not stat.S_ISFIFO(st.st_mode):
        return None
    major, minor, ino = _dev(st)
    holders = scan_holders({path}, deadline, modes=False).by_link.get(path, [])
    return KernelWait(what="fifo_open", path=path, file=f"{major:02x}:{minor:02x}:{ino}",
                      holder_pids=sorted({h.pid for h in holders if h.pid != pid}),
                      access="write" if flags & 0o3 else "read")


def kernel_waits(pid: int, syscalls: dict[int, str], mem: TargetMemory,
                 deadline: float | None = None) -> dict[int, KernelWait]:
    """tid -> the file lock or FIFO open it is blocked in (threads in neither are left out)."""
    out: dict[int, KernelWait] = {}
    locks: list[FileLock] | None = None
    loaded = False
    for tid, raw in syscalls.items():
        nr, args = parse_syscall(raw)
        if nr is None or nr < 0 or not args:
            continue
        lock_kind = None
        if nr in HOST_SYSCALLS.get("flock", ()):
            lock_kind = "flock"
        elif nr in HOST_SYSCALLS.get("fcntl", ()) and len(args) > 1 and args[1] in FCNTL_WAIT_CMDS:
            lock_kind = "record_lock"
        if lock_kind is not None:
            if not loaded:
                locks, loaded = read_locks(), True
            out[tid] = _lock_wait(pid, tid, args[0], lock_kind, locks)
            continue
        if nr in HOST_SYSCALLS.get("open", ()) and mem.ok:
            plain = nr == min(HOST_SYSCALLS["open"])     # open(path, flags) vs openat(dirfd, path, flags)
            if plain and HOST_SYSCALLS["open"] != frozenset({56, 437}):
                path_arg, flags, dirfd = args[0], args[1] if len(args) > 1 else 0, _AT_FDCWD
            elif len(args) > 2:
                path_arg, flags = args[1], args[2]
                dirfd = args[0] - (1 << 64) if args[0] >= 1 << 63 else args[0]
                dirfd = dirfd if dirfd < (1 << 31) else dirfd - (1 << 32)
            else:
                continue
            path = _c_string(mem, path_arg)
            if path is None:
                continue
            found = _fifo_wait(pid, path, flags, dirfd, deadline)
            if found is not None:
                out[tid] = found
    return out
