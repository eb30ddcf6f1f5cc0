"""Where a bare process logs, and what its log says: for `capture --pid` without a scenario.

A service started as ``cmd > engine.log 2>&1`` has that file on fds 1 and 2; /proc/PID/fd
names it. Its tail gives the same things a run's log follower gives: banner, start-up phase,
the pids the log prefixes name, and the error lines at the end. Read-only, bounded.
"""

from __future__ import annotations

import os
import time

from kvdiag.capture.procfs import log_files
from kvdiag.logs.lines import LogState, feed_line
from kvdiag.model.kinds import EnginePhase
from kvdiag.model.run import EngineRecord

TAIL_BYTES = 256 * 1024
TAIL_LINES = 200
# Error lines count as "how it ended" only when this close to the end of the log.
RECENT_LINES = 30


def read_tail(path: str, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The last complete lines of ``path`` (at most ``max_bytes``), [] when unreadable."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read(max_bytes)
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]          # the first line was cut in the middle
    return lines


def log_record(pid: int, name: str) -> EngineRecord | None:
    """An EngineRecord built from the log file ``pid`` writes to, or None when it logs to no file."""
    paths = log_files(pid)
    if not paths:
        return None
    state = LogState()
    lines = read_tail(paths[0])
    for line in lines:
        feed_line(state, line, name)
    phase = state.phase if state.events else EnginePhase.NOT_STARTED
    try:   # how long ago it last wrote: a start-up that still prints progress is moving
        idle: float | None = max(0.0, time.time() - os.stat(paths[0]).st_mtime)
    except OSError:
        idle = None
    recent = set(lines[-RECENT_LINES:])
    errors = [e for e in state.errors if e in recent or any(e in ln for ln in recent)]
    return EngineRecord(name=name, allocator="external", phase=phase, healthy=phase is EnginePhase.SERVING,
                        log_path=paths[0], log_tail=list(state.tail)[-TAIL_LINES:], last_log_line=state.last_line,
                        banners=state.banners, pids=dict(state.pids),
                        error="\n".join(errors[-4:]) or None, log_idle_s=idle)
