"""diagnose(bundle) -> Diagnosis: the whole run's conclusion as a pure function of its bundle.

Three layers, each read only from the bundle (no I/O, no clock):
- the per-engine verdicts and the overall verdict (:func:`kvdiag.analyze.overall.analyze_by_engine`);
- the run-level judgement: an interrupted run, and what a soak's load phase said (a server
  that stopped answering, a load where every request failed, a load that never saturated the
  KV pool: :mod:`kvdiag.analyze.soak`);
- for ``kvdiag ab``, the comparison of the two nested runs (their bundles are passed in).

The run stores the result in ``bundle.diagnosis``; ``kvdiag report`` renders that, and
``kvdiag analyze`` recomputes it and must agree.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvdiag.analyze.classify import views_memo
from kvdiag.analyze.engines import judge_engines
from kvdiag.analyze.outcome import thread_waits
from kvdiag.analyze.overall import analyze, analyze_by_engine
from kvdiag.analyze.soak import judged_soak, saturation_verdict, served_verdict
from kvdiag.analyze.xverdict import judge_across
from kvdiag.errors import ExitCode
from kvdiag.model.bundle import Bundle
from kvdiag.model.health import engine_health
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.run import EngineRecord
from kvdiag.model.verdict import ABComparison, ABEngine, ABSide, Diagnosis, ThreadWait, Verdict, WaitPurpose

AB_SIDES = ("stock", "fixed")


def exit_code_for(verdict: Verdict) -> int:
    """The contract's exit code, as the verdict kind defines it (``KIND_SPECS`` in kvdiag.model): 10 hang,
    4 crash or OOM, 3 no access or no evidence read, 5 nothing to judge (stopped/traced, exited, zombie,
    not Python, kernel thread), 6 a soak that never saturated, 0 otherwise."""
    return verdict.kind.exit_code


def diagnose(bundle: Bundle, runs: Mapping[str, Bundle] | None = None) -> Diagnosis:
    """What the run that wrote ``bundle`` concluded. ``runs``: the nested runs' bundles (ab)."""
    with views_memo():
        diag = _conclude(bundle, runs)
        diag.engines = judge_engines(bundle, diag.verdicts_by_engine)
        diag.thread_waits = _cited_stuck(thread_waits(bundle), diag.verdict) or None
    return diag


def _cited_stuck(waits: list[ThreadWait], verdict: Verdict) -> list[ThreadWait]:
    """A named hang's cited threads that wait on an outcome and did not advance over the window are stuck: the
    rule that named the hang (a GIL or lock cycle) showed that no other thread of the process completes the
    wait, which the per-thread judgement alone leaves open (a report beside a GIL cycle would count no stuck
    wait). A thread not observed stays "not observed"."""
    if not verdict.kind.is_hang or verdict.kind is VerdictKind.UNKNOWN:
        return waits
    cited = {(e.node, e.pid, e.tid) for e in verdict.evidence}
    return [w.model_copy(update={"stuck": True})
            if w.purpose is WaitPurpose.OUTCOME and w.advanced is False and (w.node, w.pid, w.tid) in cited else w
            for w in waits]


def complete(bundle: Bundle, runs: Mapping[str, Bundle] | None = None) -> Diagnosis:
    """The diagnosis stored in ``bundle``, with what a bundle written before it was stored lacks judged
    now (the engines' health lines and banner risks); a bundle without one is diagnosed."""
    diag = bundle.diagnosis
    if diag is None:
        return diagnose(bundle, runs)
    if diag.engines is None:
        diag = diag.model_copy(update={"engines": judge_engines(bundle, diag.verdicts_by_engine)})
    return diag


def _conclude(bundle: Bundle, runs: Mapping[str, Bundle] | None) -> Diagnosis:
    if bundle.interrupted:
        reason = bundle.interrupted_reason or "interrupted"
        return Diagnosis(verdict=Verdict(kind=VerdictKind.UNKNOWN, summary=f"run interrupted: {reason}",
                                         confidence=Confidence.LOW),
                         exit_code=ExitCode.INTERRUPTED, notes=["the run was interrupted: no verdict"])
    if bundle.runs:
        return _diagnose_ab(bundle, runs or {})
    verdict, by_engine = analyze(bundle), analyze_by_engine(bundle)
    code = exit_code_for(verdict)
    notes: list[str] = []
    soak = None if bundle.soak is None else judged_soak(bundle.soak, bundle.metrics)
    if soak is not None and verdict.kind is VerdictKind.HEALTHY:
        if soak.server_unreachable:
            engine = bundle.engines[0] if bundle.engines else None
            where = f" ({engine.url})" if engine is not None and engine.url else ""
            name = engine.name if engine is not None else "server"
            verdict = Verdict(kind=VerdictKind.CRASH, confidence=Confidence.MEDIUM, engine=name,
                              summary=f"{name}: stopped answering during the soak{where}",
                              findings=verdict.findings)
            code = exit_code_for(verdict)
            notes.append("the server stopped answering during the load: crash")
        elif soak.all_requests_failed:
            code = ExitCode.FAILED
            notes.append("every request failed: the soak tested nothing (exit 1)")
        elif soak.saturated is False and not soak.stalled:
            verdict = saturation_verdict(verdict, soak)
            code = exit_code_for(verdict)
            notes.append("no stall, but the KV cache never got near full: inconclusive (exit 6)")
        else:
            verdict = served_verdict(verdict, soak)
    graph = judge_across(bundle)[1]
    return Diagnosis(verdict=verdict, verdicts_by_engine=by_engine, exit_code=code, notes=notes,
                     wait_graph=graph if graph.edges else None)


def _side(label: str, rel: str, sub: Bundle) -> ABSide:
    diag = sub.diagnosis if sub.diagnosis is not None else diagnose(sub)
    return ABSide(verdict=diag.verdict.kind, summary=diag.verdict.summary, exit_code=diag.exit_code, bundle=rel,
                  report=f"{label}/report.html",
                  engines={e.name: _engine_line(e, diag.verdicts_by_engine.get(e.name)) for e in sub.engines})


def _engine_line(e: EngineRecord, verdict: Verdict | None) -> ABEngine:
    health = engine_health(e, verdict)
    return ABEngine(phase=e.phase, healthy=health.healthy, health=health.line, startup_s=e.startup_s)


def _diagnose_ab(bundle: Bundle, runs: Mapping[str, Bundle]) -> Diagnosis:
    missing = [label for label in AB_SIDES if label not in runs or label not in bundle.runs]
    if missing:
        return Diagnosis(verdict=Verdict(kind=VerdictKind.UNKNOWN, confidence=Confidence.LOW,
                                         summary=f"A/B bundle without its {' and '.join(missing)} run(s)"),
                         exit_code=ExitCode.FAILED)
    # Each side is judged fresh from its own bundle, exactly as `kvdiag analyze SIDE` would.
    diags = {label: diagnose(runs[label]) for label in AB_SIDES}
    stock, fixed = diags["stock"].verdict, diags["fixed"].verdict
    reproduced = stock.kind.is_hang
    fixed_ok = fixed.kind is VerdictKind.HEALTHY
    ok = reproduced and fixed_ok
    summary = (f"stock: {stock.kind.value}; fixed: {fixed.kind.value} — "
               + ("the fixed allocator removes the hang the stock one reproduces" if ok
                  else "A/B did not separate: "
                  + ("stock did not reproduce" if not reproduced else "fixed is not healthy")))
    verdict = Verdict(kind=stock.kind if reproduced else fixed.kind, summary=summary,
                      confidence=Confidence.HIGH if ok else Confidence.MEDIUM,
                      evidence=stock.evidence, cycle=stock.cycle)
    sides = {label: _side(label, bundle.runs[label], runs[label].model_copy(update={"diagnosis": diags[label]}))
             for label in AB_SIDES}
    by_engine = {"stock": stock, "fixed": fixed}
    by_engine.update({f"{label}/{name}": v for label in AB_SIDES
                      for name, v in diags[label].verdicts_by_engine.items()})
    return Diagnosis(verdict=verdict, verdicts_by_engine=by_engine,
                     exit_code=ExitCode.OK if ok else ExitCode.FAILED,
                     ab=ABComparison(stock=sides["stock"], fixed=sides["fixed"], separated=ok))
