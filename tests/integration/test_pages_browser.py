"""The sweep, `ab --repeat` and watch pages as a browser lays them out (headless Chromium at 1280 x 800): the
header bar with the exit code on the first screen, nothing wider than the window, a phase grid whose cells
are drawn apart and labelled, and the watch's plots with no label over another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cdp import chromium, evaluate

from kvdiag.analyze.diagnosis import diagnose
from kvdiag.model.bundle import Bundle
from kvdiag.model.sweep import SweepAxis, SweepCell, SweepReport, SweepRun
from kvdiag.report import run_view, write_view
from kvdiag.report.sweep import render_sweep_html
from kvdiag.report.sweepview import sweep_view
from kvdiag.runs.sweep.summarize import conclude

BUNDLE = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "soak_gil_cycle" / "bundle.json"

_LAYOUT = """JSON.stringify({
  bar: (document.querySelector('header.top') || {}).innerText || '',
  barBottom: (h => h ? h.getBoundingClientRect().bottom : 1e9)(document.querySelector('header.top')),
  wide: document.documentElement.scrollWidth - window.innerWidth,
  cells: [...document.querySelectorAll('.grid .c')].map(c => {
    const r = c.getBoundingClientRect();
    return {text: c.innerText.trim(), l: r.left, r: r.right, t: r.top, b: r.bottom};
  }),
  plots: [...document.querySelectorAll('svg.plot')].map(svg => [...svg.querySelectorAll('text')].map(t => {
    const r = t.getBoundingClientRect();
    return {text: t.textContent, l: r.left, r: r.right, t: r.top, b: r.bottom};
  })),
})"""


def _runs(hung: bool, n: int) -> list[SweepRun]:
    return [SweepRun(index=i, outcome="hang" if hung else "healthy", exit_code=10 if hung else 0,
                     verdict="gil_cycle" if hung else "healthy", signature="gil_cycle-3716a34488aa" if hung else None,
                     time_to_hang_s=1.2 if hung else None, time_to_healthy_s=None if hung else 1.6)
            for i in range(n)]


def _sweep() -> SweepReport:
    cells = [SweepCell(key=f"r{res}p{pages}", params={"min_reserved_pages": res, "kv_per_layer_mb": 2.0 * pages},
                       features={"vlm.pages_per_layer": pages, "vlm.min_reserved_pages": res, "vlm.prealloc": True,
                                 "vlm.allocator": "stock"}, runs=_runs(pages <= res, 1))
             for res in (1, 2, 3) for pages in (1, 2, 3, 4)]
    axes = [SweepAxis(field="engines.vlm.sim.min_reserved_pages", values=[1, 2, 3], label="min_reserved_pages"),
            SweepAxis(field="engines.vlm.sim.kv_per_layer_mb", values=[2.0, 4.0, 6.0, 8.0], label="kv_per_layer_mb")]
    return conclude(SweepReport(scenario="two-engine", axes=axes, cells=cells, cells_planned=12, finished=True))


def _ab() -> SweepReport:
    axes = [SweepAxis(field="allocator", values=["stock", "fixed"], label="allocator")]
    cells = [SweepCell(key=a, params={"allocator": a}, repeat=3, runs=_runs(a == "stock", 3))
             for a in ("stock", "fixed")]
    return conclude(SweepReport(command="ab", scenario="two-engine", axes=axes, repeat=3, finished=True, cells=cells))


def _watch_page(out: Path) -> Path:
    """The page `kvdiag watch` writes for a stalled server: a recorded stall's bundle, /metrics and timeline,
    judged as a watch judges it (no soak of its own)."""
    bundle = Bundle.model_validate(json.loads(BUNDLE.read_text()))
    bundle.soak = None
    out.mkdir()
    return write_view(out, run_view(bundle, diagnose(bundle), out_dir=out, command="watch --url http://h:8000"))[
        "report.html"]


def _overlapping(boxes: list[dict[str, float]]) -> list[tuple[object, object]]:
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]
            if not (a["r"] <= b["l"] or b["r"] <= a["l"] or a["b"] <= b["t"] or b["b"] <= a["t"])]


def test_sweep_ab_and_watch_pages_read_in_a_browser(tmp_path: Path) -> None:
    browser = chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    sweep, ab = tmp_path / "sweep.html", tmp_path / "ab.html"
    sweep.write_text(render_sweep_html(sweep_view(_sweep())))
    ab.write_text(render_sweep_html(sweep_view(_ab())))
    pages = {"sweep": (sweep, 10, 12), "ab": (ab, 0, 2), "watch": (_watch_page(tmp_path / "watch"), 10, 0)}
    for name, (page, code, cells) in pages.items():
        seen = evaluate(browser, page, _LAYOUT, tmp_path / f"{name}-browser")
        assert isinstance(seen, dict)
        assert f"exit code: {code}" in seen["bar"] and seen["barBottom"] <= 800, (name, seen["bar"])
        assert seen["wide"] <= 0, (name, seen["wide"])          # nothing wider than the window
        assert len(seen["cells"]) == cells, (name, seen["cells"])
        assert all(c["text"] and c["r"] - c["l"] > 20 for c in seen["cells"]), (name, seen["cells"])
        assert not _overlapping(seen["cells"]), name
        if name == "watch":
            assert len(seen["plots"]) == 3, seen["plots"]
            for texts in seen["plots"]:
                assert "stall detected" in {t["text"] for t in texts}, texts
                assert not _overlapping(texts), (name, _overlapping(texts))
