"""Small, dependency-free readers of /proc shared by launch, watch, capture and the sim.

Only what several stages need: a process's stat fields, the process table, and
process trees. Richer per-thread evidence lives in kvdiag.capture.procfs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class Stat(NamedTuple):
    pid: int
    state: str        # R, S, D, T, t, Z, X, ...
    ppid: int
    pgid: int
    utime: int        # clock ticks
    stime: int


# wchan of a task parked in futex(2): newer kernels say futex_do_wait, older ones (and the seed's
# report) futex_wait_queue / futex_wait_queue_me.
FUTEX_WCHANS = ("futex_wait_queue", "futex_do_wait", "futex_wait_queue_me", "futex_wait")


def read_text(path: str | Path) -> str | None:
    """A /proc (or /sys) file's text, or None when it is gone or refused (never raises)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def read_stat(pid: int, tid: int | None = None) -> Stat | None:
    """/proc/<pid>[/task/<tid>]/stat parsed past the comm field; None if gone or unreadable."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    try:
        with open(path, "rb") as fh:
            rest = fh.read().rsplit(b")", 1)[-1].split()
    except OSError:
        return None
    if len(rest) < 13:
        return None
    return Stat(tid or pid, rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[11]), int(rest[12]))


def all_stats() -> list[Stat]:
    """Stat of every process visible now."""
    out: list[Stat] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = read_stat(int(entry))
            if st is not None:
                out.append(st)
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    st = read_stat(pid)
    return st is not None and st.state not in ("Z", "X")


def children(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    return [st.pid for st in all_stats() if st.ppid == pid]


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, breadth first; empty when ``root`` does not exist."""
    if read_stat(root) is None:
        return []
    kids: dict[int, list[int]] = {}
    for st in all_stats():
        kids.setdefault(st.ppid, []).append(st.pid)
    out: list[int] = []
    queue = [root]
    while queue:
        pid = queue.pop(0)
        if pid not in out:
            out.append(pid)
            queue.extend(sorted(kids.get(pid, [])))
    return out


def group_alive(pgid: int) -> bool:
    """True while a non-zombie process is in process group ``pgid``.

    killpg(pgid, 0) alone is not enough: an unreaped zombie leader keeps the
    group "existing" although nothing in it runs any more.
    """
    return any(st.pgid == pgid and st.state not in ("Z", "X") for st in all_stats())
