"""The sweep's report: report.json follows schema/sweep.schema.json (kept equal to the model's), and the
HTML renders only what the report holds, every text escaped, no network."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema

from kvdiag.model.sweep import SweepAxis, SweepCell, SweepReport, SweepRun
from kvdiag.report.sweep import render_sweep_html
from kvdiag.report.sweepview import sweep_view
from kvdiag.runs.sweep.summarize import conclude

SCHEMA = Path(__file__).resolve().parents[2] / "schema" / "sweep.schema.json"


def _report(evil: str = "x") -> SweepReport:
    cells = []
    for res in (1, 2):
        for pages in (1, 2):
            hung = pages <= res
            run = SweepRun(index=0, outcome="hang" if hung else "healthy", exit_code=10 if hung else 0,
                           verdict="gil_cycle" if hung else "healthy",
                           signature="gil_cycle-3716a34488aa" if hung else None, engine="vlm", summary=evil,
                           time_to_hang_s=1.2 if hung else None, time_to_healthy_s=None if hung else 1.6,
                           banner_risk=hung, path=f"cells/c{res}{pages}/run-0")
            cells.append(SweepCell(key=f"c{res}{pages}", params={"min_reserved_pages": res, "tag": evil,
                                                                 "kv_per_layer_mb": 2.0 * pages},
                                   features={"vlm.pages_per_layer": pages, "vlm.min_reserved_pages": res,
                                             "vlm.prealloc": True, "vlm.allocator": "stock"}, runs=[run]))
    axes = [SweepAxis(field="engines.vlm.sim.min_reserved_pages", values=[1, 2], label="min_reserved_pages"),
            SweepAxis(field="env.TAG", values=[evil], label="tag"),
            SweepAxis(field="engines.vlm.sim.kv_per_layer_mb", values=[2.0, 4.0], label="kv_per_layer_mb")]
    return conclude(SweepReport(scenario=evil, axes=axes, cells=cells, cells_planned=4, finished=True))


def test_the_schema_file_is_the_models_and_a_report_follows_it() -> None:
    schema = json.loads(SCHEMA.read_text())
    generated = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "kvdiag sweep report.json",
                 **SweepReport.model_json_schema()}
    assert schema == generated, "regenerate schema/sweep.schema.json from kvdiag.model.sweep.SweepReport"
    report = _report()
    jsonschema.validate(json.loads(report.model_dump_json()), schema)
    assert report.exit_code == 10 and report.rule is not None and report.rule.fits
    assert report.cells[0].interval is not None and report.cells[0].interval.method == "clopper-pearson"


def test_html_is_escaped_self_contained_and_draws_every_cell() -> None:
    evil = '<script>alert("x")</script>'
    page = render_sweep_html(sweep_view(_report(evil)))
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    assert page.count('class="c') >= 4 and "pages per layer ≤ min_reserved_pages" in page
    assert 'href="cells/c11/run-0/report.html"' in page


def test_ab_repeat_reports_each_side_as_a_rate_with_its_bound() -> None:
    def side(alloc: str, outcome: str, n: int) -> SweepCell:
        runs = [SweepRun(index=i, outcome=outcome, exit_code=10 if outcome == "hang" else 0,  # type: ignore[arg-type]
                         verdict="gil_cycle" if outcome == "hang" else "healthy") for i in range(n)]
        return SweepCell(key=alloc, params={"allocator": alloc}, runs=runs, repeat=n)

    axes = [SweepAxis(field="allocator", values=["stock", "fixed"], label="allocator")]
    report = conclude(SweepReport(command="ab", axes=axes, repeat=10, finished=True,
                                  cells=[side("stock", "hang", 10), side("fixed", "healthy", 10)]))
    assert report.ab is not None and report.ab.separated and report.ab.intervals_disjoint
    assert report.ab.fixed.text == "fixed 0/10 hung, 95 % bound ≤ 31 %"
    assert report.ab.stock.text == "stock 10/10 hung, 95 % bound ≥ 69 %"
    assert report.exit_code == 0 and report.summary.startswith("stock 10/10 hung")
    flaky = conclude(SweepReport(command="ab", axes=axes, repeat=10, finished=True,
                                 cells=[side("stock", "hang", 10), side("fixed", "hang", 10)]))
    assert flaky.ab is not None and not flaky.ab.separated and flaky.exit_code == 1


def test_a_bisected_axis_reports_where_the_outcome_changes() -> None:
    cells = []
    for res, pages_run in ((2, (1, 2, 3, 8)), (9, (1, 8))):
        for pages in pages_run:
            hung = pages <= res
            run = SweepRun(index=0, outcome="hang" if hung else "healthy", exit_code=0, verdict="x")
            cells.append(SweepCell(key=f"{res}-{pages}", params={"min_reserved_pages": res,
                                                                 "kv_per_layer_mb": 2.0 * pages}, runs=[run]))
    axes = [SweepAxis(field="engines.vlm.sim.min_reserved_pages", values=[2, 9], label="min_reserved_pages"),
            SweepAxis(field="engines.vlm.sim.kv_per_layer_mb", values=[2.0, 16.0], label="kv_per_layer_mb",
                      bisect=True)]
    report = conclude(SweepReport(axes=axes, cells=cells, finished=True))
    assert report.boundaries == ["min_reserved_pages=2: hang at kv_per_layer_mb=4, healthy at 6",
                                 "min_reserved_pages=9: hang from kv_per_layer_mb=2 to 16 (no change)"]
    assert "healthy at 6" in render_sweep_html(sweep_view(report))


def test_an_interrupted_sweep_states_no_rule_and_names_what_did_not_run() -> None:
    """Only a healthy cell finished before Ctrl-C (one more was under way): "no cell hangs" would be a
    false all-clear, since the hanging cells never ran."""
    full = _report()
    ran = next(c for c in full.cells if c.key == "c12")            # 2 pages > 1 reserved: healthy
    pending = next(c for c in full.cells if c.key == "c22").model_copy(update={"outcome": "pending", "runs": []})
    report = conclude(full.model_copy(update={"cells": [ran, pending], "interrupted": True, "finished": False}))
    assert report.rule is not None and not report.rule.fits
    assert report.rule.text.startswith("no rule from a partial grid: 3 of 4 cell(s) did not run"), report.rule.text
    assert "c22" in report.rule.text
    assert "no cell hangs" not in report.summary


def test_the_sweep_page_has_the_run_reports_header_bar_with_its_exit_code() -> None:
    page = render_sweep_html(sweep_view(_report()))
    bar = page.split('<header class="top">', 1)[1].split("</header>", 1)[0]
    assert "exit code: <b>10</b>" in bar and "command: <b>sweep</b>" in bar, bar


def test_a_one_axis_grid_and_an_ab_page_say_each_thing_once() -> None:
    """`ab --repeat`'s page printed its sentence twice, and a one-axis grid labelled "all cells" and an empty
    "rows ↑"; a three-axis sweep keeps each panel's setting and both axes."""
    axes = [SweepAxis(field="allocator", values=["stock", "fixed"], label="allocator")]
    cells = [SweepCell(key=a, params={"allocator": a}, repeat=2, runs=[
        SweepRun(index=i, outcome="hang" if a == "stock" else "healthy", exit_code=10 if a == "stock" else 0,
                 verdict="gil_cycle" if a == "stock" else "healthy") for i in range(2)]) for a in ("stock", "fixed")]
    ab = conclude(SweepReport(command="ab", axes=axes, repeat=2, finished=True, cells=cells))
    assert ab.ab is not None
    page = render_sweep_html(sweep_view(ab))
    main = page.split("<main>", 1)[1]
    assert main.count(html_escape(ab.ab.text)) == 1, main[:1500]
    grid = main.split("<h2>Phase diagram</h2>", 1)[1].split("<h2>", 1)[0]
    assert "rows ↑" not in grid and "all cells" not in grid and "columns → allocator" in grid
    three = render_sweep_html(sweep_view(_report())).split("<h2>Phase diagram</h2>", 1)[1].split("<h2>", 1)[0]
    assert "rows ↑ tag" in three and "columns → kv_per_layer_mb" in three and "min_reserved_pages=1" in three


def html_escape(text: str) -> str:
    import html
    return html.escape(text, quote=True)
