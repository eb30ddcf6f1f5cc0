"""A capture leaves every target as it found it: its state read before, a stop the tools left undone
(SIGCONT, once, and only when kvdiag's own tools caused it), and what changed said in findings."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

from kvdiag.model.run import Finding
from kvdiag.osread.stat import read_stat
from kvdiag.osread.status import read_status
from kvdiag.osread.tasks import list_tids


@dataclass
class Before:
    exists: bool
    state: str = ""
    tracer: int = 0
    tids: list[int] = field(default_factory=list)
    stopped_tids: frozenset[int] = frozenset()    # threads in T/t (stopped or tracing stop)

    @property
    def any_stopped(self) -> bool:
        return _stopped(self.state) or bool(self.stopped_tids)


def observe(pid: int) -> Before:
    st = read_status(pid)
    if st is None:
        return Before(exists=False)
    tids = list_tids(pid)
    stopped = frozenset(tid for tid in tids
                        if (ts := read_stat(pid, tid)) is not None and _stopped(ts.state))
    return Before(True, st.state, st.tracer_pid or 0, tids, stopped)


def _stopped(code: str) -> bool:
    return code in ("T", "t")


def resume_if_left_stopped(pid: int, before: Before, settle_s: float = 1.0,
                           watch_s: float = 0.0) -> Finding | None:
    """SIGCONT ``pid`` when capture left it (or one of its threads) stopped; None when it is fine.

    Only a process that was running when found is resumed: one that was already stopped (a
    user's SIGSTOP, job control) is left as found. A tracer still attached is given ``settle_s``
    to go (a tool killed mid-attach is detached as the kernel reaps it); one that stays is
    reported by :func:`verify_untouched`, never fought over. ``watch_s``: after a tool was killed,
    how long to keep looking for the stop to appear (the detached target runs briefly before the
    SIGSTOP the tool's attach sent takes effect).
    """
    if not before.exists or before.any_stopped:
        return None
    # One check-and-resume at a time: a chain thread and an interrupted capture may both look.
    with _RESUME_LOCK:
        return _resume_if_left_stopped(pid, settle_s, watch_s)


_RESUME_LOCK = threading.Lock()


def _resume_if_left_stopped(pid: int, settle_s: float, watch_s: float) -> Finding | None:
    start = time.monotonic()
    after = observe(pid)
    while after.exists and time.monotonic() - start < max(settle_s, watch_s):
        if after.any_stopped and not after.tracer:
            break
        if not after.any_stopped and time.monotonic() - start >= watch_s:
            break
        time.sleep(0.02)
        after = observe(pid)
    if not after.exists or not after.any_stopped or after.tracer:
        return None
    what = (f"process {pid}" if _stopped(after.state) else
            f"{len(after.stopped_tids)} thread(s) of process {pid}")
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError as exc:
        return Finding(kind="capture_left_stopped", pid=pid,
                       message=f"{what} stopped after capture (a debugger killed mid-attach); "
                               f"could not resume it: {exc}")
    # Bounded check that it runs again (SIGCONT resumes every thread of a stopped process).
    end = time.monotonic() + settle_s
    again = observe(pid)
    while again.exists and again.any_stopped and time.monotonic() < end:
        time.sleep(0.02)
        again = observe(pid)
    how = "kvdiag resumed it with SIGCONT" if not (again.exists and again.any_stopped) else \
        "kvdiag sent SIGCONT but it is still stopped"
    return Finding(kind="capture_left_stopped", pid=pid,
                   message=f"{what} was left stopped after capture (a debugger killed mid-attach); {how}")


def verify_untouched(pid: int, before: Before, settle_s: float = 1.0,
                     resumed: Finding | None = None) -> list[Finding]:
    """Findings when capture left ``pid`` traced, stopped or short of threads; resumes a stop we caused.

    ``resumed``: a stop already undone during this capture (after one of its tools), reported once.
    """
    findings: list[Finding] = []
    if not before.exists:
        return findings
    deadline = time.monotonic() + settle_s
    after = observe(pid)
    # A tool killed mid-attach detaches as the kernel reaps it; give that a moment.
    while after.exists and after.tracer and not before.tracer and time.monotonic() < deadline:
        time.sleep(0.02)
        after = observe(pid)
    if not after.exists or (after.state in ("Z", "X") and before.state not in ("Z", "X")):
        how = "exited" if not after.exists else "exited (now a zombie, not reaped yet)"
        findings.append(Finding(kind="target_exited", pid=pid, message=f"process {pid} {how} during capture"))
        return findings
    if after.tracer and not before.tracer:
        findings.append(Finding(kind="capture_left_traced", pid=pid,
                                message=f"process {pid} is still ptrace-attached by pid {after.tracer} after capture"))
    left = resume_if_left_stopped(pid, before, settle_s=max(0.0, deadline - time.monotonic()))
    if left is not None or resumed is not None:
        findings.append(left or resumed)  # type: ignore[arg-type]
    gone = sorted(set(before.tids) - set(after.tids))
    if gone:
        findings.append(Finding(kind="threads_exited", pid=pid,
                                message=f"{len(gone)} thread(s) of {pid} exited during capture: "
                                        f"{', '.join(map(str, gone[:10]))}"))
    return findings
