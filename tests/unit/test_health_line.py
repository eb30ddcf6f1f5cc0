"""The health line is derived from the verdict and the probes, for every verdict kind.

A report once said `healthy: no` beside the verdict `healthy`. Every rendering (report.json, the
terminal table, report.md, report.html) must agree with the engine's verdict: "yes" exactly when
its verdict is healthy; what /health said is named, never contradicted.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from reportkit import build_report, view_of, write_outputs
from rich.console import Console

from kvdiag.model.bundle import Bundle
from kvdiag.model.health import engine_health
from kvdiag.model.kinds import EnginePhase, VerdictKind
from kvdiag.model.run import EngineRecord
from kvdiag.model.verdict import Verdict
from kvdiag.report.markdown import render_markdown
from kvdiag.report.terminal import render_terminal


def _record(probe_ok: bool, phase: EnginePhase) -> EngineRecord:
    return EngineRecord(name="eng", allocator="stock", phase=phase, url="http://127.0.0.1:1", healthy=probe_ok)


@pytest.mark.parametrize("kind", list(VerdictKind))
@pytest.mark.parametrize("probe_ok", [True, False])
@pytest.mark.parametrize("phase", [EnginePhase.SERVING, EnginePhase.STALLED, EnginePhase.BANNER])
def test_health_line_agrees_with_the_verdict(kind: VerdictKind, probe_ok: bool, phase: EnginePhase,
                                             tmp_path: Path) -> None:
    rec = _record(probe_ok, phase)
    verdict = Verdict(kind=kind, summary=f"eng: {kind.value}", engine="eng")
    health = engine_health(rec, verdict)
    assert health.healthy is (kind is VerdictKind.HEALTHY)
    assert health.line.startswith("yes") is health.healthy
    if not health.healthy:
        assert kind.value.replace("_", " ") in health.line          # says why
        assert ("/health still answered" in health.line) is probe_ok  # and what the probe said

    bundle = Bundle(command="repro two-engine", engines=[rec])
    report = build_report(bundle, verdict, command="repro two-engine", exit_code=0,
                          verdicts_by_engine={"eng": verdict})
    entry = report.engines[0]
    assert entry.healthy is health.healthy and entry.health == health.line
    assert entry.health_endpoint_ok is probe_ok

    out = io.StringIO()
    render_terminal(view_of(report), Console(file=out, width=250, color_system=None))
    assert health.line in out.getvalue()
    assert f"| {health.line} |" in render_markdown(view_of(report, bundle))
    page = write_outputs(tmp_path, bundle, verdict, command="repro two-engine", exit_code=0,
                         verdicts_by_engine={"eng": verdict})["report.html"].read_text()
    assert ('<span class="badge ok">yes</span>' in page) is health.healthy
    assert (health.note is not None and health.note in page) or health.note is None


def test_without_a_verdict_the_probe_and_phase_decide() -> None:
    assert engine_health(_record(True, EnginePhase.SERVING), None).healthy
    stalled = engine_health(_record(True, EnginePhase.STALLED), None)
    assert not stalled.healthy and stalled.line == "no (/health still answered)"
    assert not engine_health(_record(False, EnginePhase.SERVING), None).healthy


def test_every_verdict_kind_is_one_complete_definition() -> None:
    """A kind is one line in KIND_SPECS: exit code, rank, display; the schema lists it too."""
    import json as _json

    from kvdiag.analyze.diagnosis import exit_code_for
    from kvdiag.analyze.rulekit import SEVERITY
    from kvdiag.model.kinds import KIND_SPECS
    from kvdiag.report.html import KIND_CLASS

    assert set(KIND_SPECS) == set(VerdictKind)
    assert sorted(spec.rank for spec in KIND_SPECS.values()) == list(range(len(VerdictKind)))
    assert SEVERITY[0] is VerdictKind.GIL_CYCLE and SEVERITY[-1] is VerdictKind.HEALTHY
    schema = _json.loads((Path(__file__).resolve().parents[2] / "schema" / "report.schema.json").read_text())
    assert set(schema["$defs"]["verdict_kind"]["enum"]) == {k.value for k in VerdictKind}
    for kind, spec in KIND_SPECS.items():
        assert exit_code_for(Verdict(kind=kind, summary="x")) == spec.exit_code
        assert KIND_CLASS[kind.value] == spec.display
        assert kind.is_hang is (spec.outcome == "hang") and (spec.exit_code == 10) is kind.is_hang
