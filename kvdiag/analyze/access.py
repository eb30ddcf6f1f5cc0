"""No evidence is not health: outcomes for processes whose evidence could not be had. Pure.

A process kvdiag may not read (ptrace refused), one that exited before or
during capture, a zombie, a process without a Python interpreter and a kernel
thread each get their own outcome (:data:`kvdiag.model.kinds.NO_EVIDENCE_KINDS`),
never ``healthy`` and never a deadlock kind. What /proc still shows without
ptrace (state, wchan per thread, CPU over the sampling window) is reported as
partial evidence, never judged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

from kvdiag.agent.protocol import AGENT_FIX
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import Confidence, ThreadState, VerdictKind
from kvdiag.model.run import Finding
from kvdiag.model.verdict import Verdict

# Tool errors that mean "the kernel refused", whatever the preflight thought.
_PERMISSION_WORDS = ("permission denied", "operation not permitted", "eperm", "eacces",
                     "ptrace: operation not permitted", "not permitted")
_STACK_TOOLS = ("py-spy", "pystack", "gdb")
# The tools that attach with ptrace(2); py-spy --nonblocking only reads memory (process_vm_readv, else
# /proc/PID/mem), so it may still read Python stacks where every attach is refused.
_PTRACE_TOOLS = ("pystack", "gdb")
# When every process has an outcome, the group's verdict is the first of these that occurs.
_ORDER = (VerdictKind.NO_ACCESS, VerdictKind.NO_EVIDENCE, VerdictKind.EXITED, VerdictKind.ZOMBIE,
          VerdictKind.KERNEL_THREAD, VerdictKind.NOT_PYTHON)


def _gone(proc: ProcessEvidence, findings: list[Finding]) -> bool:
    return not proc.alive or any(f.pid == proc.pid and f.kind in ("target_exited", "process_gone")
                                 for f in findings)


def _refused_by_kernel(proc: ProcessEvidence, tools: Collection[str]) -> list[str]:
    """Errors of the ``tools`` that ran on ``proc``, when the kernel refused every one of them and none read
    it; [] otherwise, and for a process another debugger holds (EPERM means that, not a permission problem)."""
    if proc.tracer_pid or (proc.access is not None and proc.access.tracer_pid):
        return []
    ran = [t for t in proc.tools if t.tool in tools and t.error and "not installed" not in t.error
           and "skipped" not in t.error]
    if not ran or any(t.ok for t in proc.tools if t.tool in tools):
        return []
    if all(any(w in (t.error or "").lower() for w in _PERMISSION_WORDS) for t in ran):
        return [f"{t.tool}: {t.error}" for t in ran]
    return []


def read_by_agent(proc: ProcessEvidence) -> bool:
    """The process's in-process agent answered: its stacks and GIL state were read without ptrace."""
    return any(t.tool == "agent" and t.ok for t in proc.tools)


def _agent_unanswered(proc: ProcessEvidence) -> bool:
    """The agent was asked (the agent path) and did not answer, and no stack tool read the process either."""
    asked = [t for t in proc.tools if t.tool == "agent"]
    return bool(asked) and not any(t.ok for t in asked) and not any(
        t.ok for t in proc.tools if t.tool in _STACK_TOOLS)


def _tools_refused(proc: ProcessEvidence) -> list[str]:
    """Errors of the stack tools that ran, when every one of them was refused by the kernel."""
    return _refused_by_kernel(proc, _STACK_TOOLS)


def attach_refused(proc: ProcessEvidence) -> list[str]:
    """Errors of the ptrace tools (pystack, gdb) that ran on ``proc``, when the kernel refused every one of
    them and none read it (py-spy may still have read its Python stacks through /proc/PID/mem)."""
    return _refused_by_kernel(proc, _PTRACE_TOOLS)


@dataclass(frozen=True)
class FoundState:
    """The target as found: stopped, and by whom it is traced (None: no tracer known)."""

    stopped: bool = False
    tracer_pid: int | None = None
    traced_inferred: bool = False    # no TracerPid read, but the kernel refused every attach the preflight allowed


def found_state(proc: ProcessEvidence) -> FoundState:
    """Stopped / traced from /proc, else from the preflight (which reads the target's state whatever
    backends run), else traced inferred from the ptrace tools' refusals."""
    a = proc.access
    stopped = proc.state is ThreadState.STOPPED or (
        proc.state is ThreadState.UNKNOWN and a is not None and a.state in ("T", "t") and a.tracer_pid in (0, None))
    tracer = proc.tracer_pid or (a.tracer_pid if a is not None and a.tracer_pid else None)
    inferred = False
    if tracer is None and not proc.threads and a is not None and a.ptrace_ok and a.tracers_ok:
        # ptrace_attach() answers EPERM to a permitted caller only when the target is already traced.
        ran = [t for t in proc.tools if t.tool in ("pystack", "gdb") and t.error and "not installed" not in t.error
               and "skipped" not in t.error]
        inferred = bool(ran) and not any(t.ok for t in proc.tools if t.tool in _STACK_TOOLS) and all(
            any(w in (t.error or "").lower() for w in _PERMISSION_WORDS) for t in ran)
    return FoundState(stopped=stopped, tracer_pid=tracer, traced_inferred=inferred)


def partial_evidence(proc: ProcessEvidence) -> str:
    """One line of what /proc shows without ptrace, labelled partial."""
    parts = [f"state {proc.state.value}"]
    if proc.threads:
        states = Counter(t.state.value for t in proc.threads)
        parts.append(f"{len(proc.threads)} thread{'s' if len(proc.threads) != 1 else ''} ("
                     + ", ".join(f"{n} {st}" for st, n in states.most_common()) + ")")
        wchans = Counter(t.wchan for t in proc.threads if t.wchan)
        if wchans:
            parts.append("wchan " + ", ".join(f"{w} x{n}" if n > 1 else w for w, n in wchans.most_common(4)))
    if proc.cpu_percent is not None:
        parts.append(f"CPU {proc.cpu_percent:g}% over the sampling window")
    p = proc.progress
    if p is not None and p.window_s:
        grew = sum(p.log_growth.values())
        parts.append(f"over {p.window_s:g}s: {p.cpu_ticks} CPU ticks" + (f", log grew {grew} bytes" if p.log_growth
                                                                          else ""))
    return f"partial evidence for pid {proc.pid} (/proc only, not judged): " + "; ".join(parts)


def process_outcome(proc: ProcessEvidence, findings: list[Finding]) -> VerdictKind | None:
    """The no-evidence outcome of one captured process, or None when its evidence can be judged."""
    a = proc.access
    if a is not None and a.kernel_thread:
        return VerdictKind.KERNEL_THREAD
    if (a is not None and a.zombie) or proc.state is ThreadState.ZOMBIE:
        return VerdictKind.ZOMBIE
    if _gone(proc, findings):
        return VerdictKind.EXITED
    state = found_state(proc)
    if state.stopped or state.tracer_pid is not None or state.traced_inferred:
        return None     # judged by the target-state rule: stopped or traced, its own outcome
    if ((a is not None and not (a.ptrace_ok and a.tracers_ok)) or _tools_refused(proc)) and not read_by_agent(proc):
        return VerdictKind.NO_ACCESS
    if a is not None and a.python is False:
        return VerdictKind.NOT_PYTHON
    if _agent_unanswered(proc):
        # Read through the agent path and the agent gave nothing: /proc alone is no stack evidence.
        return VerdictKind.NO_EVIDENCE
    if not proc.threads or _stacks_unread(proc):
        # Alive, readable, and yet not one thread (or not one stack) was read (every tool missing,
        # failing or timing out): nothing to judge, and certainly not health.
        return VerdictKind.NO_EVIDENCE
    return None


def _stacks_unread(proc: ProcessEvidence) -> bool:
    """Every stack tool that was asked for is missing or failed, so /proc is all there is (thread states,
    wait channels, native frames unwound from memory, no Python frame), and /proc read no owner from
    memory (a GIL holder or a mutex owner) that proves a hang on its own. Without them, a deadlock
    and an idle server look alike: judging would be a guess."""
    asked = [t for t in proc.tools if t.tool.split("-", 1)[0] in ("py", "pystack", "gdb", "agent") and not t.skipped]
    if not asked or any(t.ok for t in asked):
        return False
    holders = proc.progress.gil_holders if proc.progress is not None else []
    read_owner = any(h is not None for h in holders) or any(t.futex_owner_tid is not None for t in proc.threads)
    return not read_owner


def judgeable(procs: list[ProcessEvidence], findings: list[Finding]) -> list[ProcessEvidence]:
    """The processes whose evidence the hang rules may judge.

    A process whose stacks were refused but whose memory kvdiag could read (it started the process;
    Yama keeps only the tools out) still has real evidence (GIL holder, mutex owners from /proc):
    a hang found there stands. Health is never claimed for it (:func:`evidence_outcome`).
    """
    out = []
    for p in procs:
        kind = process_outcome(p, findings)
        if kind is None or (kind is VerdictKind.NO_ACCESS and p.access is not None and p.access.ptrace_ok
                            and p.threads):
            out.append(p)
    return out


def _label(proc: ProcessEvidence) -> str:
    return f"pid {proc.pid}" + (f" ({proc.comm})" if proc.comm else "")


def _no_access(name: str, procs: list[ProcessEvidence], engine: str | None) -> Verdict:
    first = procs[0]
    a = first.access
    refused = list(a.refused) if a is not None else []
    refused += _tools_refused(first)
    fixes = list(a.fixes) if a is not None else []
    if not fixes:
        fixes = [f"run kvdiag as root keeping your PATH (sudo env \"PATH=$PATH\" kvdiag ...) or as the user "
                 f"that owns pid {first.pid}"]
    if AGENT_FIX not in fixes:
        fixes.append(AGENT_FIX)
    why = refused[1] if len(refused) > 1 else (refused[0] if refused else "ptrace was refused")
    others = f" (and {len(procs) - 1} more process{'es' if len(procs) > 2 else ''})" if len(procs) > 1 else ""
    findings = [Finding(kind="access_refused", pid=first.pid, engine=engine, message=r) for r in refused]
    findings += [Finding(kind="access_fix", pid=first.pid, engine=engine, message=f) for f in fixes]
    findings += [Finding(kind="partial_evidence", pid=p.pid, engine=engine, message=partial_evidence(p))
                 for p in procs]
    return Verdict(kind=VerdictKind.NO_ACCESS, confidence=Confidence.HIGH, engine=engine, findings=findings,
                   summary=(f"{name}: no access: kvdiag may not read {_label(first)}{others}: {why}. "
                            f"Fix: {fixes[0]}. Nothing was judged: the stacks a verdict needs could not be "
                            "read (what /proc shows is listed as partial evidence)"))


def _no_evidence(name: str, procs: list[ProcessEvidence], engine: str | None) -> Verdict:
    first = procs[0]
    failed = [t for t in first.tools if not t.ok and t.error]
    why = "; ".join(f"{t.tool}: {t.error}" for t in failed) or "no capture tool ran"
    missing = [t.tool for t in failed if "not installed" in (t.error or "")]
    findings = [Finding(kind="no_evidence", pid=p.pid, engine=engine,
                        message=f"pid {p.pid}: no thread could be read: "
                                + ("; ".join(f"{t.tool}: {t.error}" for t in p.tools if not t.ok and t.error)
                                   or "no capture tool ran")) for p in procs]
    others = f" (and {len(procs) - 1} more process{'es' if len(procs) > 2 else ''})" if len(procs) > 1 else ""
    what = "could be read" if not first.threads else "had a stack read (/proc alone cannot tell a deadlock from idle)"
    lead = f"{', '.join(missing)} not installed: " if missing else ""
    return Verdict(kind=VerdictKind.NO_EVIDENCE, confidence=Confidence.HIGH, engine=engine, findings=findings,
                   summary=(f"{name}: no evidence: {lead}not one thread of {_label(first)}{others} {what} ({why}). "
                            "Nothing was judged: install the missing tools or use --tools with the ones that "
                            "work (kvdiag doctor lists them), then capture again"))


def _single(kind: VerdictKind, name: str, proc: ProcessEvidence, engine: str | None) -> Verdict:
    a = proc.access
    status = f" ({a.exit_status})" if a is not None and a.exit_status else ""
    partial = [Finding(kind="partial_evidence", pid=proc.pid, engine=engine, message=partial_evidence(proc))]
    if kind is VerdictKind.EXITED:
        summary = (f"{name}: {_label(proc)} exited before or during capture{status}: nothing left to diagnose, "
                   "nothing judged")
        partial = []
    elif kind is VerdictKind.ZOMBIE:
        parent = f" by its parent pid {proc.ppid}" if proc.ppid else ""
        summary = (f"{name}: {_label(proc)} is a zombie: it exited{status} and was not reaped{parent}; nothing runs "
                   "in it, nothing to diagnose")
    elif kind is VerdictKind.KERNEL_THREAD:
        summary = (f"{name}: {_label(proc)} is a kernel thread: capture refused (kernel threads run no Python and "
                   "no stack tool can attach); pass the pid of the engine process")
        partial = []
    else:
        summary = (f"{name}: {_label(proc)} runs no Python interpreter: kvdiag diagnoses Python engines "
                   "(pass the pid of the engine process); nothing judged")
    return Verdict(kind=kind, confidence=Confidence.HIGH, engine=engine, findings=partial, summary=summary)


def evidence_outcome(name: str, procs: list[ProcessEvidence], findings: list[Finding],
                     engine: str | None = None) -> Verdict | None:
    """The group's outcome when its evidence could not be had, else None (judge it normally).

    Any process that could not be read makes the group ``no_access`` (health cannot be claimed
    for it). Otherwise the group gets an outcome only when none of its processes could be judged.
    """
    if not procs:
        return None
    outcomes = {p.pid: process_outcome(p, findings) for p in procs}
    refused = [p for p in procs if outcomes[p.pid] is VerdictKind.NO_ACCESS]
    if refused:
        return _no_access(name, refused, engine)
    unread = [p for p in procs if outcomes[p.pid] is VerdictKind.NO_EVIDENCE]
    if unread:
        return _no_evidence(name, unread, engine)
    if any(o is None for o in outcomes.values()):
        return None
    for kind in _ORDER:
        hit = next((p for p in procs if outcomes[p.pid] is kind), None)
        if hit is not None:
            return _single(kind, name, hit, engine)
    return None


__all__ = ["FoundState", "attach_refused", "evidence_outcome", "found_state", "judgeable", "partial_evidence",
           "process_outcome", "read_by_agent"]
