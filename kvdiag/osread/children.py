"""A process's children (/proc/PID/task/TID/children, every thread's). No policy."""

from __future__ import annotations

from kvdiag.osread.files import PROC, read_text
from kvdiag.osread.tasks import list_tids


def children(pid: int) -> list[int] | None:
    """Child pids of ``pid`` (any of its threads may have forked them); None when /proc cannot say."""
    tids = list_tids(pid)
    if not tids:
        return None
    out = {int(x) for tid in tids for x in (read_text(f"{PROC}/{pid}/task/{tid}/children") or "").split()
           if x.isdigit()}
    return sorted(out)
