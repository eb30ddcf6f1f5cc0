"""One process's verdict: its own state first (stopped, traced by someone else), then the process rules in
order, strongest first (:data:`PROCESS_RULES`: GPU kernel hang, GIL cycle, GIL held while blocked, lock
inversion, blocked read, lost wakeup, an idle GPU wait, stuck waiters, nothing can move, an unresolved wait).
"""

from __future__ import annotations

from kvdiag.analyze.access import found_state
from kvdiag.analyze.classify import ThreadView, WaitKind, classify_process
from kvdiag.analyze.evidence import BLOCKED_KEYS
from kvdiag.analyze.gil_rules import gil_held_warning, rule_gil_cycle, rule_gil_held_blocked
from kvdiag.analyze.gpu import rule_gpu_idle_wait, rule_gpu_kernel_hang
from kvdiag.analyze.io_rules import rule_blocked_read, rule_unresolved_wait
from kvdiag.analyze.lock_rules import rule_lock_inversion, rule_lost_wakeup, rule_nothing_can_move, rule_stuck_unknown
from kvdiag.analyze.rulekit import cited, place
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.run import Finding
from kvdiag.model.verdict import Verdict


def rule_target_state(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    """A stopped or foreign-traced target: its own outcome; the stacks' story, if any, as a finding.

    The state and tracer come from /proc, else from the preflight's reading of the target as found, else
    (traced) from every ptrace tool being refused although the preflight found attaching allowed."""
    found = found_state(proc)
    stopped = found.stopped or bool(views) and all(t.stopped or t.kind is WaitKind.STOPPED for t in views)
    tracer = found.tracer_pid
    if not stopped and tracer is None and not found.traced_inferred:
        return None
    inner = _first_verdict(proc, views, engine)
    if inner is not None and inner.kind in (VerdictKind.UNKNOWN, VerdictKind.INCONCLUSIVE):
        inner = None    # "nothing runs" says nothing about a process that cannot run
    also = f"; its stacks show {inner.kind.value}: {inner.summary}" if inner is not None else ""
    findings = [Finding(kind="mechanism", pid=proc.pid, engine=engine, message=inner.kind.value)] if inner else []
    evidence = inner.evidence if inner is not None else [cited(t, "stopped" if stopped else "traced", engine,
                                                                                 BLOCKED_KEYS)
                                                         for t in views[:2]]
    if stopped and tracer is None:
        return Verdict(kind=VerdictKind.STOPPED, confidence=Confidence.HIGH, engine=engine, evidence=evidence,
                       findings=findings, cycle=inner.cycle if inner else [],
                       summary=(f"{place(proc)} is stopped (SIGSTOP, job control or a debugger): none of its "
                                f"threads can run until it gets SIGCONT; capture left it stopped{also}"))
    if tracer is None:
        refused = "; ".join(f"{t.tool}: {t.error}" for t in proc.tools if not t.ok and t.error)
        return Verdict(kind=VerdictKind.TRACED, confidence=Confidence.MEDIUM, engine=engine, evidence=evidence,
                       findings=findings, cycle=inner.cycle if inner else [],
                       confidence_reasons=["- its TracerPid was not read (/proc not captured)"],
                       summary=(f"{place(proc)} is most likely traced by another debugger: the preflight found "
                                f"attaching allowed, yet the kernel refused every ptrace tool ({refused}), which "
                                f"it does when a tracer already holds the process; nothing was judged{also}"))
    return Verdict(kind=VerdictKind.TRACED, confidence=Confidence.HIGH, engine=engine, evidence=evidence,
                   findings=findings, cycle=inner.cycle if inner else [],
                   summary=(f"{place(proc)} is traced by pid {tracer} (another debugger or strace)"
                            f"{' and stopped by it' if stopped else ''}: kvdiag's ptrace tools cannot attach and "
                            f"the tracer may be holding it; left as found{also}"))


# A thread parked on a busy GPU goes first: the host waits around it are its consequences.
PROCESS_RULES = (rule_gpu_kernel_hang, rule_gil_cycle, rule_gil_held_blocked, rule_lock_inversion, rule_blocked_read,
                 rule_lost_wakeup, rule_gpu_idle_wait, rule_stuck_unknown, rule_nothing_can_move, rule_unresolved_wait)


def _first_verdict(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    """The first decisive rule's verdict; an inconclusive one only when no rule decides."""
    pending: Verdict | None = None
    for rule in PROCESS_RULES:
        verdict = rule(proc, views, engine)
        if verdict is None:
            continue
        if verdict.kind is not VerdictKind.INCONCLUSIVE:
            return verdict
        pending = pending or verdict
    return pending


def analyze_process(proc: ProcessEvidence, machine: str | None = None, engine: str | None = None) -> Verdict | None:
    """The first rule that matches ``proc``'s threads, or None (no hang evidence).

    A stopped or foreign-traced target gets its own outcome first. Every rule that infers a hang
    from "nothing can move" checks the sample window: a thread that woke or used CPU, or a
    process that wrote its log or did I/O, is not parked for good.
    """
    if not proc.alive:
        return None
    if not proc.threads:   # no stack read: only the target's state (as found) can be said
        return rule_target_state(proc, [], engine)
    views = classify_process(proc, machine)
    state = rule_target_state(proc, views, engine)
    if state is not None:
        return state
    return _first_verdict(proc, views, engine)


def process_findings(proc: ProcessEvidence, machine: str | None = None, engine: str | None = None) -> list[Finding]:
    """Warnings about a process that are not a verdict: a GIL held across a blocking call with no
    waiter yet, and what the progress sample saw."""
    if not proc.alive or not proc.threads:
        return []
    out: list[Finding] = []
    views = classify_process(proc, machine)
    warn = gil_held_warning(proc, views, engine)
    if warn is not None:
        out.append(warn)
    p = proc.progress
    if p is not None and p.advanced:
        grew = ", ".join(f"{path.rsplit('/', 1)[-1]} +{n} B" for path, n in p.log_growth.items() if n > 0)
        io = ", ".join(f"{k} +{n}" for k, n in p.io_delta.items() if n > 0)
        moved = "; ".join(x for x in (grew, io) if x)
        out.append(Finding(kind="progress", pid=proc.pid, engine=engine, message=(
            f"pid {proc.pid} advanced during the {p.window_s:.2f}s sample window ({moved}): not called a "
            "deadlock unless a cycle of owners is proven")))
    return out
