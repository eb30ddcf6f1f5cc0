"""An engine's verdict: its processes' verdicts (each judged with its peers) plus what only the run
knows: OOM and crash text, exit codes, the decode-stall metrics signature, start-up progress.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvdiag.analyze.access import evidence_outcome, judgeable
from kvdiag.analyze.classify import classify_process
from kvdiag.analyze.confidence import healthy_confidence
from kvdiag.analyze.enginelog import starting_verdict, telling_line
from kvdiag.analyze.gpu import gpu_wait_progressed
from kvdiag.analyze.outcome import (
    ends_by_itself,
    health_basis,
    lock_after_death,
    progress_seen,
    spinners_on,
    stuck_outcome,
)
from kvdiag.analyze.peers import PeerJudge, servers_were_paused_too
from kvdiag.analyze.process import analyze_process, process_findings
from kvdiag.analyze.rulekit import STACKS_ONLY, TARGET_STATES, severity
from kvdiag.defaults import KV_FULL, STALL_WINDOW_S
from kvdiag.kvcached.banner import assess_risk_for
from kvdiag.logs.lines import CRASH_AT_EXIT, OOM_AT_EXIT
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import Confidence, EnginePhase, ProcessRole, VerdictKind
from kvdiag.model.run import EngineRecord, Finding, MetricsSnapshot
from kvdiag.model.verdict import Verdict


def _engine_text(e: EngineRecord) -> str:
    return "\n".join([e.error or "", e.last_log_line or "", *e.log_tail])


def decode_stalled(e: EngineRecord, metrics: Iterable[MetricsSnapshot], window_s: float) -> str | None:
    """A sentence when the metrics show requests running, KV near full and no new tokens for ``window_s``."""
    snaps = sorted((m for m in metrics if m.engine in (e.name, None)), key=lambda m: m.t)
    snaps = [m for m in snaps if m.generation_tokens is not None]
    if len(snaps) < 2 or not (e.healthy or e.phase in (EnginePhase.SERVING, EnginePhase.STALLED)):
        return None
    last = snaps[-1]
    if (last.running or 0) <= 0 or (last.kv_cache_usage or 0) < KV_FULL:
        return None
    i = len(snaps) - 1
    while i > 0 and snaps[i - 1].generation_tokens == last.generation_tokens:
        i -= 1
    flat = last.t - snaps[i].t
    if flat < window_s or not all((m.running or 0) > 0 for m in snaps[i:]):
        return None
    return (f"{last.running:.0f} request(s) running, KV cache {last.kv_cache_usage:.1%} full, "
            f"no token generated for {flat:.1f}s")


_STATS = re.compile(r"Avg generation throughput: (?P<gen>[\d.]+) tokens/s, Running: (?P<run>\d+) reqs?, "
                    r"Waiting: (?P<wait>\d+) reqs?, GPU KV cache usage: (?P<kv>[\d.]+)%")


STALL_STATS_LINES = 3


def decode_stalled_from_log(e: EngineRecord) -> str | None:
    """vLLM's periodic stats lines: the last few all say requests running, KV near full, 0 tokens/s."""
    stats = [m for ln in e.log_tail if (m := _STATS.search(ln))]
    last = stats[-STALL_STATS_LINES:]
    if len(last) < STALL_STATS_LINES:
        return None
    if not all(float(m["gen"]) == 0.0 and int(m["run"]) > 0 and float(m["kv"]) / 100 >= KV_FULL for m in last):
        return None
    m = last[-1]
    return (f"{m['run']} request(s) running, {m['wait']} waiting, KV cache {m['kv']}% full, generation "
            f"throughput 0.0 tokens/s on the last {len(last)} stats lines of the log")


_telling_line = telling_line   # the line a crash/OOM summary names (kvdiag.analyze.enginelog)


def banner_findings(e: EngineRecord) -> list[Finding]:
    out: list[Finding] = []
    for b in e.banners:
        risk = assess_risk_for(b, e.allocator)
        if risk.risky:  # one finding per reason, worded like the run's own banner findings so they merge
            out += [Finding(kind="banner_risk", engine=e.name, message=reason) for reason in risk.reasons]
    return out


def _process_verdicts(procs: list[ProcessEvidence], machine: str | None, engine: str | None,
                      bundle: Bundle | None = None) -> tuple[list[Verdict], list[Finding]]:
    """Each process's verdict, worst first; a blocked read on a hung captured peer defers to the peer
    (it becomes a finding, the peer's own verdict is the cause)."""
    ordered = sorted(procs, key=lambda p: (p.role is not ProcessRole.ENGINE_CORE, p.role is ProcessRole.API_SERVER))
    judge = PeerJudge(bundle, machine) if bundle is not None else None
    out: list[Verdict] = []
    deferred: list[Finding] = []
    adopted: set[int] = set()
    for p in ordered:
        v = analyze_process(p, machine, engine)
        if v is None:
            continue
        if STACKS_ONLY in v.confidence_reasons and bundle is not None:
            v = servers_were_paused_too(v, p, bundle, machine)
        root = judge.defer(p, v) if judge is not None else None
        own = judge.waits_on_own_engine(p, v) if judge is not None and root is None else []
        if own:
            deferred.append(Finding(kind="waits_on_own_engine", pid=p.pid, engine=engine, message=(
                f"pid {p.pid} ({p.role.value}) waits on {', '.join(f'pid {q}' for q in own)} of its own engine, "
                f"whose stacks show no hang: waiting for its engine, not a deadlock. {v.summary}")))
            continue
        producers = judge.live_producers(p, v) if judge is not None and root is None else []
        if producers:
            deferred.append(Finding(kind="waits_on_live_producer", pid=p.pid, engine=engine, message=(
                f"pid {p.pid} waits to read from {', '.join(f'pid {q}' for q in producers)}, which is alive, has "
                f"written before and sleeps in a timer loop: a slow producer, not a stuck one. {v.summary}")))
            continue
        if root is None:
            out.append(v)
            continue
        q, qv = root
        assert judge is not None
        qp = judge.by_pid[q]
        whose = f" of engine {qp.engine}" if qp.engine and qp.engine != p.engine else ""
        # A hung peer no engine claims (captured without an engine record) is this engine's cause.
        if q not in {x.pid for x in procs} and qp.engine not in judge.engines and q not in adopted:
            adopted.add(q)
            out.append(qv.model_copy(deep=True, update={"engine": engine}))
        deferred.append(Finding(kind="waits_on_hung_peer", pid=p.pid, engine=engine, message=(
            f"pid {p.pid} waits on pid {q}{whose}, which is itself hung ({qv.kind.value}): a consequence, not the "
            f"cause. {v.summary}")))
    # stable: worst first, engine core first among equals
    return sorted(out, key=lambda v: severity(v.kind)), deferred


def _any_running(procs: list[ProcessEvidence], machine: str | None) -> bool:
    for p in procs:
        if any(t.running and not t.idle_by_design for t in classify_process(p, machine)):
            return True
    return False


_STARTING = (EnginePhase.LAUNCHING, EnginePhase.LOADING, EnginePhase.PROFILING, EnginePhase.KV_INIT,
             EnginePhase.BANNER)


def engine_verdict(name: str, e: EngineRecord | None, procs: list[ProcessEvidence], bundle: Bundle,
                   relevant: list[Finding]) -> Verdict:
    """Verdict for one engine (or one group of processes captured without an engine record).

    Health is earned: a verdict that would let the run pass (healthy, slow_start) or that rests on a log line
    alone (a crash or OOM line in the log of processes still alive) gives way to a stuck outcome-wait
    (kvdiag.analyze.outcome): a thread waiting for the result of work already started while nothing in the
    captured processes advanced. The log's line stays, as a finding."""
    verdict = _engine_verdict(name, e, procs, bundle, relevant)
    from_log = verdict.kind in (VerdictKind.CRASH, VerdictKind.OOM) and e is not None and \
        e.exit_code in (None, 0) and e.phase is not EnginePhase.EXITED
    if verdict.kind.is_hang:
        verdict = _chained(verdict, stuck_outcome(bundle, judgeable(procs, relevant), e.name if e else None))
        spin = spinners_on(bundle, {x.pid for x in verdict.evidence})
        if spin:
            verdict.summary += "; " + "; ".join(spin[:2])
        return verdict
    if verdict.kind not in (VerdictKind.HEALTHY, VerdictKind.SLOW_START) and not from_log:
        return verdict
    hang = stuck_outcome(bundle, judgeable(procs, relevant), e.name if e else None)
    if hang is None and from_log and e is not None and not _log_names_gone(bundle, verdict):
        return _live_despite_log(name, e, procs, bundle, relevant, verdict)
    if hang is None and verdict.kind is VerdictKind.SLOW_START:
        return _slow_start_earned(verdict, procs, bundle)
    if hang is None:
        return verdict
    hang.engine = verdict.engine
    hang.findings = [*hang.findings, *verdict.findings]
    spin = spinners_on(bundle, {x.pid for x in hang.evidence})
    if spin:
        hang.summary += "; " + "; ".join(spin[:2])
    if from_log:
        hang.findings.append(Finding(kind="log_line", engine=verdict.engine, message=(
            f"the log says {verdict.kind.value}, but the processes it could be about are alive and their stacks "
            f"show a stuck wait; a log line is the verdict only for a process that is gone: {verdict.summary}")))
        alive = {p.pid for p in bundle.processes if p.alive}
        gone = [int(m) for m in re.findall(r"(?:pid[= ]|[Pp]rocess |\(pid )(\d+)", verdict.summary)
                if int(m) not in alive]
        if gone:
            hang.summary += (f"; the log's {verdict.kind.value} line is about pid {gone[0]}, which is gone: the live "
                             f"process waits on a gone peer ({verdict.summary})")
        else:
            hang.summary += (f"; the log's {verdict.kind.value} line is a finding, not the verdict: the processes that "
                             f"could have written it are alive ({verdict.summary})")
    elif verdict.kind is VerdictKind.SLOW_START:
        hang.findings.append(Finding(kind="stale_log", engine=verdict.engine, message=(
            f"not slow_start: {verdict.summary}; the log did not grow during the window, and a stale line never "
            "outvotes a stuck wait")))
    return hang


def _slow_start_earned(verdict: Verdict, procs: list[ProcessEvidence], bundle: Bundle) -> Verdict:
    """``slow_start`` needs something that grows during the window (its log, CPU, I/O): a start-up line written
    before the capture proves nothing. Observed and nothing moved, yet no wait was found stuck: ``unknown``,
    saying what would decide."""
    moved = progress_seen(procs, bundle.host.machine)
    if moved:
        verdict.confidence_reasons = [*verdict.confidence_reasons, f"+ still moving: {'; '.join(moved[:2])}"]
    if moved is None or moved:
        return verdict
    if ends_by_itself(procs, bundle.host.machine):
        verdict.confidence_reasons = [*verdict.confidence_reasons, "- nothing grew during the window; a thread in a "
                                      "timed wait or a short sleep may still go on by itself"]
        return verdict
    return Verdict(kind=VerdictKind.UNKNOWN, confidence=Confidence.LOW, engine=verdict.engine,
                   evidence=verdict.evidence, findings=[*verdict.findings, Finding(
                       kind="stale_log", engine=verdict.engine,
                       message=f"not slow_start: {verdict.summary}; nothing grew during the window")],
                   summary=(f"{verdict.summary.split(':', 1)[0]}: stopped in start-up, not slow: nothing advanced "
                            "during the window (no log growth, no CPU, no I/O in any captured process), yet no "
                            "wait was found stuck; a longer window, or stacks with --locals, would decide"))


def _log_names_gone(bundle: Bundle, verdict: Verdict) -> bool:
    """The log (or the verdict read from it) names a process that is no longer alive: the line may be about
    it, and a crash or OOM of a process that is gone is a verdict."""
    alive = {p.pid for p in bundle.processes if p.alive}
    named = {int(m) for m in re.findall(r"(?:pid[= ]|[Pp]rocess |\(pid )(\d+)", verdict.summary)}
    named |= {int(m) for e in bundle.engines for ln in e.log_tail
              for m in re.findall(r"(?:\bpid[= ]|[Pp]rocess |\(pid )(\d+)", ln)}
    return bool(named - alive) or not any(p.alive for p in bundle.processes)


def _live_despite_log(name: str, e: EngineRecord, procs: list[ProcessEvidence], bundle: Bundle,
                      relevant: list[Finding], verdict: Verdict) -> Verdict:
    """A crash or OOM line in the log of processes that are all alive is a finding beside what their stacks
    show: a thread waiting with no timeout on a lock a dead thread may have held, else the stacks' own verdict."""
    note = Finding(kind="log_line", engine=verdict.engine, message=(
        f"the log says {verdict.kind.value}, but every process it could be about is alive; a log line is the "
        f"verdict only for a process that is gone: {verdict.summary}"))
    line = verdict.summary.split(": ", 2)[-1]
    held = lock_after_death(bundle, judgeable(procs, relevant), e.name, line)
    if held is not None:
        held.findings.append(note)
        return held
    out = _engine_verdict(name, e.model_copy(update={"error": None}), procs, bundle, relevant)
    out.findings.append(note)
    return out


def _chained(verdict: Verdict, chain: Verdict | None) -> Verdict:
    """A hang named at its root gains the waits that lead to it from another process (a flock on a lock the
    root holds, a FIFO it holds open, a child it is): the chain is said first, the root's verdict after."""
    if chain is None or not verdict.evidence or not chain.evidence or verdict.waits is not None:
        return verdict
    root = {(e.pid, e.tid) for e in verdict.evidence}
    first = chain.evidence[0]
    if (first.pid, first.tid) == (verdict.evidence[0].pid, verdict.evidence[0].tid) and \
            verdict.kind in (VerdictKind.BLOCKED_IPC_READ, VerdictKind.UNKNOWN) and chain.kind is not verdict.kind \
            and any(c.pid != first.pid for c in chain.evidence[1:]):
        # The same wait, followed further: into the peer, to the thread there that holds the answer up.
        out = chain.model_copy(deep=True)
        out.summary = out.summary.removeprefix("hang: ")
        out.findings.append(Finding(kind="mechanism", pid=first.pid, engine=verdict.engine,
                                    message=f"{verdict.kind.value}: {verdict.summary}"))
        return out
    if first.pid == verdict.evidence[0].pid or not any((c.pid, c.tid) in root for c in chain.evidence[1:]):
        return verdict
    out = verdict.model_copy(deep=True)
    text = chain.summary.removeprefix("hang: ").split(". Nothing advanced", 1)[0]
    out.summary = f"{text}. At the root: {verdict.summary}"
    out.evidence = [first, *verdict.evidence]
    if verdict.kind is VerdictKind.UNKNOWN and chain.kind is not VerdictKind.UNKNOWN:
        # The chain names what the root's own rule could not: its words replace the root's guess.
        out.kind, out.summary = chain.kind, chain.summary.removeprefix("hang: ")
        out.confidence_reasons = chain.confidence_reasons
    return out


def _engine_verdict(name: str, e: EngineRecord | None, procs: list[ProcessEvidence], bundle: Bundle,
                    relevant: list[Finding]) -> Verdict:
    machine = bundle.host.machine
    findings = (banner_findings(e) if e else []) + relevant
    findings += [f for p in procs for f in process_findings(p, machine, e.name if e else None)]
    pverdicts, deferred = _process_verdicts(judgeable(procs, relevant), machine, e.name if e else None, bundle)
    findings += deferred
    hang = pverdicts[0] if pverdicts else None

    def done(verdict: Verdict) -> Verdict:
        verdict.engine = e.name if e else verdict.engine
        seen = {(f.kind, f.message) for f in verdict.findings}
        verdict.findings += [f for f in findings if (f.kind, f.message) not in seen]
        if verdict.kind.is_hang and any(f.kind == "banner_risk" for f in findings):
            verdict.summary += "; the PageAllocator banner predicts it (see banner_risk)"
        return verdict

    if hang is not None and (moving := gpu_wait_progressed(name, hang, e)) is not None:
        return done(moving)   # a long kernel in a loop whose log still advances
    if e is not None:
        text = _engine_text(e)
        exited_badly = e.exit_code not in (None, 0) or (e.phase is EnginePhase.EXITED and e.exit_code != 0)
        if OOM_AT_EXIT.search(text) and (exited_badly or e.error):
            line = _telling_line(text, OOM_AT_EXIT)
            return done(Verdict(kind=VerdictKind.OOM, confidence=Confidence.HIGH,
                                summary=f"{name}: out of memory: {line.strip()[:200]}"))
        if exited_badly or (e.error and CRASH_AT_EXIT.search(e.error)):
            line = _telling_line(text, CRASH_AT_EXIT) or (e.error or "")
            code = f" with exit code {e.exit_code}" if e.exit_code is not None else ""
            # Without an exit code (a bare capture) the end of the log is the only witness.
            what = f"engine exited{code}" if exited_badly or e.phase is EnginePhase.EXITED else \
                "its log ends with a crash"
            return done(Verdict(kind=VerdictKind.CRASH, confidence=Confidence.HIGH if exited_badly else
                                Confidence.MEDIUM, summary=f"{name}: {what}: {line.strip()[:200]}".rstrip(": ")))
        stall = decode_stalled(e, bundle.metrics, bundle.stall_window_s or STALL_WINDOW_S)
        if stall is not None:
            if hang is not None:
                return done(Verdict(kind=VerdictKind.DECODE_STALL, confidence=hang.confidence,
                                    summary=f"{name}: decode stall: {stall}; mechanism: {hang.kind.value}: "
                                            f"{hang.summary}",
                                    evidence=hang.evidence, cycle=hang.cycle,
                                    findings=[Finding(kind="mechanism", engine=e.name, message=hang.kind.value)]))
            return done(Verdict(kind=VerdictKind.DECODE_STALL, confidence=Confidence.MEDIUM,
                                summary=f"{name}: decode stall: {stall}"))
        log_stall = decode_stalled_from_log(e)
        if log_stall is not None and (hang is None or hang.kind not in TARGET_STATES):
            mech = f"; mechanism: {hang.kind.value}: {hang.summary}" if hang is not None else ""
            return done(Verdict(kind=VerdictKind.DECODE_STALL, confidence=Confidence.MEDIUM,
                                evidence=hang.evidence if hang is not None else [],
                                summary=f"{name}: decode stall: {log_stall}{mech}"))
    if hang is not None:
        return done(hang)
    outcome = evidence_outcome(name, procs, relevant, e.name if e else None)   # no evidence is not health
    if outcome is not None:
        if e is not None and e.phase is EnginePhase.STALLED:
            outcome.summary += f"; the engine had stalled in phase {e.phase.value}"
        return done(outcome)
    stalled = e is not None and (e.phase is EnginePhase.STALLED or (bundle.stall_detected and not e.healthy))
    if stalled and e is not None:
        if _any_running(procs, machine):
            return done(Verdict(kind=VerdictKind.SLOW_START, confidence=Confidence.MEDIUM,
                                summary=f"{name}: no log progress, but threads are still using CPU: slow, "
                                        "not deadlocked"))
        what = "no stacks were captured" if not procs else "the captured threads match no rule"
        return done(Verdict(kind=VerdictKind.UNKNOWN, confidence=Confidence.LOW,
                            summary=f"{name}: stalled in phase {e.phase.value}; {what}"))
    if e is not None and e.phase in _STARTING and not e.healthy:
        return done(starting_verdict(name, e))
    basis = health_basis(procs, machine) if procs else None
    conf, reasons = healthy_confidence(e, procs, bundle, basis)
    if procs and basis is not None:
        return done(Verdict(kind=VerdictKind.HEALTHY, confidence=conf, confidence_reasons=reasons,
                            summary=f"{name}: no hang evidence; {basis[0]}"))
    state = "serving" if e is not None and (e.healthy or e.phase is EnginePhase.SERVING) else "no hang seen"
    return done(Verdict(kind=VerdictKind.HEALTHY, confidence=conf, confidence_reasons=reasons,
                        summary=f"{name}: {state}"))
