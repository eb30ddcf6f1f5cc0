"""Evidence cites frames by reference: on every saved real bundle, each cited line refers to the captured
frame it shows, and the HTML stacks highlight exactly the frames the key lines refer to."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.analyze import vocab as v
from kvdiag.analyze.diagnosis import diagnose
from kvdiag.bundle.io import load_bundle
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import Frame
from kvdiag.model.verdict import EvidenceItem
from kvdiag.report.json import report_of
from kvdiag.report.view import build_view

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"
ALL = sorted(str(p.parent.relative_to(BUNDLES)) for p in BUNDLES.glob("**/bundle.json"))


def _frame(bundle: Bundle, item: EvidenceItem, n: int) -> Frame:
    ref = item.refs[n]
    proc = next(p for p in bundle.processes if p.pid == ref.pid and ref.node in (None, p.node))
    th = next(t for t in proc.threads if t.tid == ref.tid)
    return (th.frames if ref.tool is None else th.frames_by_tool[ref.tool])[ref.index]


@pytest.mark.parametrize("name", ALL)
def test_every_cited_line_refers_to_the_frame_it_shows(name: str) -> None:
    bundle = load_bundle(BUNDLES / name)[0]
    diag = diagnose(bundle)
    items = [i for verdict in [diag.verdict, *diag.verdicts_by_engine.values()] for i in verdict.evidence]
    for item in items:
        assert len(item.refs) == len(item.frames), item.role
        for n, line in enumerate(item.frames):
            assert (item.refs[n].pid, item.refs[n].tid) == (item.pid, item.tid)
            assert line.startswith(v.describe(_frame(bundle, item, n))), (line, item.role)
    for verdict in [diag.verdict, *diag.verdicts_by_engine.values()]:
        if verdict.waits is not None and verdict.waits.root_frames:
            assert len(verdict.waits.root_refs) == len(verdict.waits.root_frames)
    # The view lights, in each cited thread's stack, the frames its key lines refer to and no other.
    view = build_view(report_of(bundle, diag), bundle)
    want = {(r.pid, r.tid, r.index) for item in diag.verdict.evidence for r in item.key_refs() if r.tool is None}
    lit = {(p.pid, t.tid, i) for p in view.processes for t in p.threads for i, f in enumerate(t.frames) if f.key}
    assert lit == want
