"""/proc/PID/stat and /proc/PID/task/TID/stat as a typed record."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.osread.files import PROC, list_numeric, read_bytes

PF_KTHREAD = 0x00200000          # task flag of kernel threads (stat field 9)


@dataclass(frozen=True)
class Stat:
    """The stat fields kvdiag reads (field numbers as proc(5) counts them)."""

    pid: int
    state: str                   # 3: R, S, D, T, t, Z, X, I
    ppid: int                    # 4
    pgid: int                    # 5
    flags: int                   # 9: PF_* task flags
    utime: int                   # 14: clock ticks in user mode
    stime: int                   # 15: clock ticks in kernel mode
    exit_code: int | None = None  # 52: wait status of an exited task (0 unless the reader may trace it)
    starttime: int = 0           # 22: clock ticks after boot when it started (with the pid: which process)

    @property
    def ticks(self) -> int:
        return self.utime + self.stime

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def parse_stat(raw: bytes | str, pid: int) -> Stat | None:
    """A stat line parsed past the comm field (which may hold spaces and parentheses); None when short."""
    data = raw.encode() if isinstance(raw, str) else raw
    rest = data.rsplit(b")", 1)[-1].split()
    if len(rest) < 13:
        return None
    try:
        exit_code = int(rest[49]) if len(rest) >= 50 else None
        starttime = int(rest[19]) if len(rest) >= 20 else 0
        return Stat(pid, rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[6]), int(rest[11]),
                    int(rest[12]), exit_code, starttime)
    except ValueError:
        return None


def read_stat(pid: int, tid: int | None = None) -> Stat | None:
    """/proc/<pid>[/task/<tid>]/stat; None if gone or unreadable."""
    path = f"{PROC}/{pid}/task/{tid}/stat" if tid is not None else f"{PROC}/{pid}/stat"
    raw = read_bytes(path)
    return parse_stat(raw, tid or pid) if raw is not None else None


def all_pids() -> list[int]:
    """Every pid visible in /proc now ([] when /proc cannot be listed)."""
    return list_numeric(PROC) or []


def all_stats() -> list[Stat]:
    """Stat of every process visible now."""
    return [st for pid in all_pids() if (st := read_stat(pid)) is not None]
