"""A process's threads (/proc/PID/task/TID): state, CPU ticks, comm, wchan, syscall line and kernel stack."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.osread.files import PROC, list_numeric, read_text
from kvdiag.osread.stat import parse_stat
from kvdiag.osread.status import parse_status


@dataclass(frozen=True)
class TaskReading:
    """One thread read once. A cheap reading (``full=False``) has only state, ticks and context switches."""

    tid: int
    state: str = "?"
    utime: int | None = None
    stime: int | None = None
    ctx_switches: int | None = None
    voluntary: int | None = None
    nonvoluntary: int | None = None
    comm: str | None = None
    wchan: str | None = None
    syscall: str | None = None              # the raw /proc/.../syscall line
    kernel_stack: tuple[str, ...] = ()      # function names, innermost first

    @property
    def ticks(self) -> int | None:
        if self.utime is None or self.stime is None:
            return None
        return self.utime + self.stime


def parse_kernel_stack(text: str) -> list[str]:
    """``[<0>] futex_wait_queue+0x60/0x90`` lines → function names, innermost first."""
    out: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("[<"):
            line = line.split("]", 1)[-1].strip()
        out.append(line.split("+", 1)[0].strip())
    return out


def list_tids(pid: int) -> list[int]:
    """The thread ids of ``pid``, sorted ([] when it is gone)."""
    return list_numeric(f"{PROC}/{pid}/task") or []


def _wchan(text: str | None) -> str | None:
    value = (text or "").strip()
    return value if value not in ("", "0") else None


def read_wchan(pid: int, tid: int | None = None) -> str | None:
    """The kernel function the task sleeps in; None when it runs or cannot be read."""
    return _wchan(read_text(f"{PROC}/{pid}/task/{tid}/wchan" if tid is not None else f"{PROC}/{pid}/wchan"))


def read_syscall(pid: int, tid: int) -> str | None:
    """The raw syscall line of a thread (``202 0x7f.. ...``, ``running``, ``-1 sp pc``); None when unreadable."""
    return read_text(f"{PROC}/{pid}/task/{tid}/syscall")


def read_task(pid: int, tid: int, full: bool = True) -> TaskReading | None:
    """One reading of thread ``tid``; None when it is gone."""
    base = f"{PROC}/{pid}/task/{tid}"
    raw = read_text(f"{base}/stat")
    if raw is None:
        return None
    st = parse_stat(raw, tid)
    status = read_text(f"{base}/status")
    parsed = parse_status(status) if status is not None else None
    switches = parsed.ctx_switches if parsed is not None else None
    cheap = TaskReading(tid=tid, state=st.state if st else "?", utime=st.utime if st else None,
                        stime=st.stime if st else None, ctx_switches=switches,
                        voluntary=parsed.voluntary if parsed is not None else None,
                        nonvoluntary=parsed.nonvoluntary if parsed is not None else None)
    if not full:
        return cheap
    comm = read_text(f"{base}/comm")
    syscall = read_text(f"{base}/syscall")
    stack = read_text(f"{base}/stack")
    return TaskReading(tid=tid, state=cheap.state, utime=cheap.utime, stime=cheap.stime, ctx_switches=switches,
                       voluntary=cheap.voluntary, nonvoluntary=cheap.nonvoluntary,
                       comm=comm.strip() if comm is not None else None, wchan=_wchan(read_text(f"{base}/wchan")),
                       syscall=syscall.strip() if syscall else None,
                       kernel_stack=tuple(parse_kernel_stack(stack)) if stack else ())


def snapshot(pid: int, full: bool = True) -> dict[int, TaskReading]:
    """Every thread of ``pid`` read once, by tid."""
    return {tid: s for tid in list_tids(pid) if (s := read_task(pid, tid, full)) is not None}
