"""Build the :class:`Report` (report.json) from a bundle and its verdict.

The report is the user-facing contract (schema/report.schema.json): every
other renderer (HTML, Markdown, terminal) reads it, never the raw bundle
alone. Its inputs were redacted where they entered (the bundle writer or loader, write_outputs).
"""

from __future__ import annotations

import json
from typing import Any

from kvdiag import __version__
from kvdiag.analyze.health import engine_health
from kvdiag.model import (
    ABComparison,
    BannerRisk,
    Bundle,
    EnginePids,
    EngineRecord,
    Finding,
    Report,
    ReportBanner,
    ReportEngine,
    Verdict,
)
from kvdiag.watch.banner import assess_risk_for


def engine_entry(rec: EngineRecord, verdict: Verdict | None = None) -> ReportEngine:
    """One ``report.engines[]`` item: the record plus banner risk and the engine's own verdict."""
    risks = [assess_risk_for(b, rec.allocator) for b in rec.banners]
    banners = [ReportBanner(**banner.model_dump(), risk=risk) for banner, risk in zip(rec.banners, risks, strict=True)]
    banner_risk: BannerRisk | None = None
    if risks:
        reasons: list[str] = []
        for risk in risks:
            reasons.extend(r for r in risk.reasons if r not in reasons)
        banner_risk = BannerRisk(risky=any(r.risky for r in risks),
                                 pages_per_layer=min(r.pages_per_layer for r in risks), reasons=reasons)
    health = engine_health(rec, verdict)
    return ReportEngine(
        name=rec.name,
        allocator=rec.allocator,
        phase=rec.phase,
        # Healthy means the engine's verdict is healthy (kvdiag.analyze.health): a stalled engine is
        # not, even when its /health still answers (vLLM's /health does not see a decode stall);
        # what /health said is kept apart and named in the health line.
        healthy=health.healthy,
        health=health.line,
        health_note=health.note,
        health_endpoint_ok=rec.healthy,
        url=rec.url,
        exit_code=rec.exit_code,
        pids=EnginePids.of(rec.pids),
        startup_s=rec.startup_s,
        banner=rec.banners[0].model_copy(deep=True) if rec.banners else None,
        banners=banners,
        banner_risk=banner_risk,
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


def build_report(bundle: Bundle, verdict: Verdict, *, command: str, exit_code: int,
                 verdicts_by_engine: dict[str, Verdict] | None = None,
                 ab: ABComparison | None = None, bundle_path: str | None = None) -> Report:
    """Assemble the (redacted) report for ``bundle`` judged as ``verdict``.

    Pure: no I/O, no clock (``created_at`` is the bundle's). Works on a partial
    bundle from an interrupted run: no processes, no engines, empty evidence.
    """
    by_engine = dict(verdicts_by_engine or {})
    engines = [engine_entry(e, by_engine.get(e.name)) for e in bundle.engines]
    report = Report(
        kvdiag_version=__version__,
        command=command or bundle.command,
        created_at=bundle.created_at,
        exit_code=exit_code,
        verdict=verdict,
        verdicts_by_engine=by_engine,
        engines=engines,
        timeline=sorted(bundle.timeline, key=lambda e: e.t),
        findings=_merge_findings(bundle.findings, verdict.findings),
        soak=bundle.soak,
        ab=ab,
        bundle_path=bundle_path,
        host=dict(bundle.host),
        scenario=bundle.scenario_path,
        stall_window_s=bundle.stall_window_s,
        interrupted=bundle.interrupted,
        environment=bundle.environment,
        redaction=bundle.redaction.model_copy(deep=True),
        stall_to_verdict_s=bundle.stall_to_verdict_s,
        outcome=ab.outcome if ab is not None else verdict.kind.value,
        simulated_engines=simulated_engines(bundle),
    )
    return report


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


def render_json(report: Report) -> str:
    """report.json text: pretty-printed, stable key order, UTF-8 (not ASCII-escaped)."""
    return json.dumps(report_dict(report), indent=2, ensure_ascii=False) + "\n"
