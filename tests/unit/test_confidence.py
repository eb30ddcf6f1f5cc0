"""A healthy verdict's confidence depends on evidence, not on timing noise, and says why.

An idle engine and a busy one are equally healthy: whether a thread happened to be on a CPU when
it was sampled must not move the confidence. Evidence raises it (the engine answered its probe,
tokens flowed under load, captured stacks show no hang) and its absence lowers it, each named.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvdiag.analyze.overall import analyze
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import Confidence, EnginePhase, VerdictKind
from kvdiag.model.run import EngineRecord, SoakStats

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


def _load(name: str) -> Bundle:
    return Bundle.model_validate(json.loads((BUNDLES / name / "bundle.json").read_text()))


def test_busy_and_idle_healthy_captures_get_the_same_confidence() -> None:
    busy, idle = analyze(_load("healthy_busy")), analyze(_load("healthy_idle"))
    assert busy.kind is idle.kind is VerdictKind.HEALTHY
    assert busy.confidence is idle.confidence
    for v in (busy, idle):  # the same reason (the two fixtures differ only in process count)
        # Captured before threads were watched over a window: the stacks alone earn no confidence.
        assert v.confidence is Confidence.LOW
        assert v.confidence_reasons == ["- the stacks show no hang pattern; progress was not observed (no window)"]


def test_the_same_run_sampled_at_other_moments_keeps_its_confidence() -> None:
    bundle = _load("healthy_busy")
    first = analyze(bundle)
    for proc in bundle.processes:  # the capture's CPU sample saw the threads asleep this time
        for t in proc.threads:
            t.cpu_ticks_delta = 0
    again = analyze(bundle)
    assert (again.kind, again.confidence, again.confidence_reasons) == (first.kind, first.confidence,
                                                                         first.confidence_reasons)


def test_evidence_raises_it_and_each_reason_is_stated() -> None:
    serving = EngineRecord(name="eng", phase=EnginePhase.SERVING, url="http://127.0.0.1:1", healthy=True)
    one = analyze(Bundle(engines=[serving]))
    assert one.kind is VerdictKind.HEALTHY and one.confidence is Confidence.MEDIUM
    assert "+ the engine answered its readiness/health probe" in one.confidence_reasons
    assert "- no stacks were captured" in one.confidence_reasons
    loaded = analyze(Bundle(engines=[serving], soak=SoakStats(requests_ok=40, tokens=9000, duration_s=8.0)))
    assert loaded.confidence is Confidence.HIGH
    assert any(r.startswith("+ tokens kept flowing under load") for r in loaded.confidence_reasons)
    silent = EngineRecord(name="eng", phase=EnginePhase.EXITED, exit_code=0)
    none = analyze(Bundle(engines=[silent]))
    assert none.kind is VerdictKind.HEALTHY and none.confidence is Confidence.LOW
    assert all(r.startswith("- ") for r in none.confidence_reasons)
