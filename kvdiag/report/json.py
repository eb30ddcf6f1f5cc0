"""Build the :class:`Report` (report.json) from a bundle and its stored diagnosis.

The report is the user-facing contract (schema/report.schema.json, generated from the models by
:mod:`kvdiag.report.schema`): every other renderer reads it through the view
(:mod:`kvdiag.report.view`). Its inputs come redacted (:mod:`kvdiag.redact`).
"""

from __future__ import annotations

import json
from typing import Any

from kvdiag import __version__
from kvdiag.model.bundle import Bundle
from kvdiag.model.judged import EngineJudgement
from kvdiag.model.report import EnginePids, Report, ReportBanner, ReportEngine
from kvdiag.model.run import EngineRecord, Finding
from kvdiag.model.verdict import Diagnosis, Verdict
from kvdiag.report.view import ReportView


def engine_entry(rec: EngineRecord, verdict: Verdict | None, judged: EngineJudgement | None) -> ReportEngine:
    """One ``report.engines[]`` item: the record, its own verdict, and the health line and banner risks the
    diagnosis stored for it (``judged``; None: a diagnosis without them, shown unjudged)."""
    risks = judged.banner_risks if judged is not None and len(judged.banner_risks) == len(rec.banners) else None
    banners = [] if risks is None else [ReportBanner(**banner.model_dump(), risk=risk)
                                        for banner, risk in zip(rec.banners, risks, strict=True)]
    return ReportEngine(
        name=rec.name,
        allocator=rec.allocator,
        phase=rec.phase,
        healthy=judged.healthy if judged is not None else False,
        health=judged.health if judged is not None else "",
        health_note=judged.health_note if judged is not None else None,
        health_endpoint_ok=rec.healthy,
        url=rec.url,
        exit_code=rec.exit_code,
        pids=EnginePids.of(rec.pids),
        startup_s=rec.startup_s,
        banner=rec.banners[0].model_copy(deep=True) if rec.banners else None,
        banners=banners,
        banner_risk=judged.banner_risk if judged is not None else None,
        last_log_line=rec.last_log_line,
        log_path=rec.log_path,
        log_tail=list(rec.log_tail[-40:]),
        error=rec.error,
        verdict=verdict.kind if verdict is not None else None,
        verdict_summary=verdict.summary if verdict is not None else None,
    )


def _merge_findings(*groups: list[Finding]) -> list[Finding]:
    seen: set[tuple[str, str, int | None, str | None]] = set()
    out: list[Finding] = []
    for group in groups:
        for f in group:
            key = (f.kind, f.message, f.pid, f.engine)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def report_of(bundle: Bundle, diagnosis: Diagnosis, *, command: str = "", bundle_path: str | None = None) -> Report:
    """report.json for ``bundle`` and the diagnosis stored with it: every judgement (verdicts, health lines,
    banner risks, the soak's saturation) is read from them, none is made here.

    Pure: no I/O, no clock (``created_at`` is the bundle's). Works on a partial bundle from an
    interrupted run: no processes, no engines, empty evidence.
    """
    verdict, by_engine, ab = diagnosis.verdict, dict(diagnosis.verdicts_by_engine), diagnosis.ab
    judged = {j.name: j for j in diagnosis.engines or []}
    return Report(
        kvdiag_version=__version__,
        command=command or bundle.command,
        created_at=bundle.created_at,
        exit_code=diagnosis.exit_code,
        verdict=verdict,
        verdicts_by_engine=by_engine,
        engines=[engine_entry(e, by_engine.get(e.name), judged.get(e.name)) for e in bundle.engines],
        timeline=sorted(bundle.timeline, key=lambda e: e.t),
        findings=_merge_findings(bundle.findings, verdict.findings),
        soak=bundle.soak,
        ab=ab,
        bundle_path=bundle_path,
        host=bundle.host.model_copy(),
        scenario=bundle.scenario_path,
        stall_window_s=bundle.stall_window_s,
        interrupted=bundle.interrupted,
        environment=bundle.environment,
        redaction=bundle.redaction.model_copy(deep=True),
        stall_to_verdict_s=bundle.stall_to_verdict_s,
        outcome=ab.outcome if ab is not None else verdict.kind.value,
        simulated_engines=simulated_engines(bundle),
        thread_waits=list(diagnosis.thread_waits or []),
    )


def simulated_engines(bundle: Bundle) -> list[str]:
    """The engines of ``bundle`` that were kvdiag's simulated engines: each record's kind, else (older
    bundles) the kind its scenario copy gives it (the scenario default is ``sim``)."""
    declared: dict[str, str] = {}
    scenario = bundle.scenario if isinstance(bundle.scenario, dict) else {}
    specs = scenario.get("engines")
    for spec in specs if isinstance(specs, list) else []:
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            declared[spec["name"]] = str(spec.get("kind") or "sim")
    # A captured process says it through its command line (`python -m kvdiag.sim serve ...`).
    sim_pids = {p.pid for p in bundle.processes if any("kvdiag.sim" in a for a in p.cmdline[:4])}
    out = []
    for e in bundle.engines:
        kind = e.kind or declared.get(e.name) or declared.get(e.name.split("/", 1)[-1])
        if kind == "sim" or (kind is None and sim_pids & set(e.pids.values())):
            out.append(e.name)
    return out


def report_dict(report: Report) -> dict[str, Any]:
    """The JSON-ready form of ``report``."""
    data: dict[str, Any] = report.model_dump(mode="json")
    return data


def render_json(view: ReportView) -> str:
    """report.json text of a view's report: pretty-printed, stable key order, UTF-8 (not ASCII-escaped)."""
    return json.dumps(report_dict(view.report), indent=2, ensure_ascii=False) + "\n"
