"""The process table read from every /proc/PID/stat: liveness, children, trees and process groups."""

from __future__ import annotations

from kvdiag.osread.stat import all_stats, read_stat


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    st = read_stat(pid)
    return st is not None and st.state not in ("Z", "X")


def ancestors(pid: int) -> list[int]:
    """The parent of ``pid``, its parent, ... up to (not including) pid 0."""
    out: list[int] = []
    st = read_stat(pid)
    while st is not None and st.ppid > 0 and len(out) < 4096:
        out.append(st.ppid)
        st = read_stat(st.ppid)
    return out


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
