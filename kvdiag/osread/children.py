"""A process's children (/proc/PID/task/TID/children, every thread's). No policy."""

from __future__ import annotations

import os


def children(pid: int) -> list[int] | None:
    """Child pids of ``pid`` (any of its threads may have forked them); None when /proc cannot say."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as fh:
                out += [int(x) for x in fh.read().split() if x.isdigit()]
        except OSError:
            continue
    return sorted(set(out))
