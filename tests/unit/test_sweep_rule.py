"""The sweep's pure parts: the rule inferred from cells, the banner check, the exact intervals, the --vary
parser's errors (an unknown field names itself and exits 2 before anything runs)."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from kvdiag.cli.main import main
from kvdiag.errors import UsageError
from kvdiag.model.sweep import SweepCell, SweepRun
from kvdiag.runs.sweep.axes import cell_scenario, parse_vary
from kvdiag.runs.sweep.plan import SweepPlan
from kvdiag.runs.sweep.rates import clopper_pearson, rate_text
from kvdiag.runs.sweep.rule import banner_check, cell_features, infer_rule
from kvdiag.scenario.loader import load_scenario


def _cell(key: str, outcome: str, banner: bool | None = None, **features: object) -> SweepCell:
    runs = [SweepRun(index=0, outcome="hang" if outcome == "hang" else "healthy", exit_code=0, verdict="x",
                     banner_risk=banner)]
    return SweepCell(key=key, params={}, features=features, outcome=outcome, runs=runs,  # type: ignore[arg-type]
                     hangs=1 if outcome == "hang" else 0, banner_predicts_hang=banner)


def _seed_grid(prealloc_values: tuple[bool, ...] = (True, False)) -> list[SweepCell]:
    cells = []
    for pre in prealloc_values:
        for pages in range(1, 11):
            for res in range(1, 11):
                hung = pre and pages <= res
                cells.append(_cell(f"{pre}-{pages}-{res}", "hang" if hung else "healthy", banner=hung, **{
                    "vlm.prealloc": pre, "vlm.allocator": "stock", "vlm.pages_per_layer": pages,
                    "vlm.min_reserved_pages": res, "vlm.max_reserved_pages": max(5, res),
                    "coder.prealloc": True, "coder.pages_per_layer": 141, "coder.min_reserved_pages": 5,
                    "kv_per_layer_mb": 2 * pages, "min_reserved_pages": res, "prealloc": pre}))
    return cells


def test_the_seed_rule_is_recovered_from_a_pages_by_reserve_by_prealloc_grid() -> None:
    rule = infer_rule(_seed_grid())
    assert rule.fits and not rule.wrong
    assert rule.text == "hangs ⇔ prealloc on and pages per layer ≤ min_reserved_pages (engine vlm)"
    assert "vlm: allocator stock" in rule.context


def test_a_constant_setting_becomes_context_not_part_of_the_rule() -> None:
    rule = infer_rule(_seed_grid((True,)))
    assert rule.text == "hangs ⇔ pages per layer ≤ min_reserved_pages (engine vlm)"
    assert "vlm: prealloc on" in rule.context


def test_no_hang_and_all_hang_and_a_cell_the_rule_cannot_fit() -> None:
    healthy = [_cell(str(i), "healthy", **{"vlm.pages_per_layer": i}) for i in range(3)]
    assert infer_rule(healthy).text == "no cell hangs"
    hung = [_cell(str(i), "hang", **{"vlm.pages_per_layer": i}) for i in range(3)]
    assert infer_rule(hung).text == "every cell hangs"
    # the same features, two outcomes: no rule can fit; the closest one names the cell it gets wrong
    clash = [_cell("a", "hang", x=1), _cell("b", "healthy", x=1), _cell("c", "healthy", x=2)]
    rule = infer_rule(clash)
    assert not rule.fits and len(rule.wrong) == 1


def test_a_threshold_rule_on_one_field_and_mixed_cells_are_kept_apart() -> None:
    cells = [_cell(str(i), "hang" if i >= 4 else "healthy", min_reserved_pages=i) for i in range(1, 8)]
    cells.append(SweepCell(key="m", params={}, features={"min_reserved_pages": 3}, outcome="mixed"))
    rule = infer_rule(cells)
    assert rule.text == "hangs ⇔ min_reserved_pages ≥ 4" and rule.fits and rule.mixed == ["m"]


def test_banner_check_reports_each_disagreement() -> None:
    cells = _seed_grid((True,))
    assert banner_check(cells).agree
    cells[0] = _cell("odd", "healthy", banner=True, **cells[0].features)
    cells[1] = _cell("nobanner", "hang", banner=None, **cells[1].features)
    check = banner_check(cells)
    assert not check.agree
    assert {(d.key, d.banner) for d in check.disagreements} == {("odd", "risk"), ("nobanner", "no banner")}
    assert "disagrees with 2 of 100 cells" in check.text


@pytest.mark.parametrize(("k", "n", "low", "high"), [(0, 10, 0.0, 0.3085), (10, 10, 0.6915, 1.0),
                                                     (3, 10, 0.0667, 0.6525), (0, 20, 0.0, 0.1684)])
def test_clopper_pearson_matches_the_exact_interval(k: int, n: int, low: float, high: float) -> None:
    iv = clopper_pearson(k, n)
    assert iv.low == pytest.approx(low, abs=1e-4) and iv.high == pytest.approx(high, abs=1e-4)


def test_rate_text_says_the_bound() -> None:
    assert rate_text("fixed", 0, 10, clopper_pearson(0, 10)) == "fixed 0/10 hung, 95 % bound ≤ 31 %"
    assert rate_text("stock", 10, 10, clopper_pearson(10, 10)) == "stock 10/10 hung, 95 % bound ≥ 69 %"


def test_vary_values_cells_and_features_follow_the_scenario() -> None:
    scen, _, _ = load_scenario(None)
    res = parse_vary("engines.vlm.sim.min_reserved_pages=1..10", scen)
    assert res.values == list(range(1, 11)) and res.label == "min_reserved_pages"
    kv = parse_vary("engines.vlm.sim.kv_per_layer_mb=2..8:2", scen)
    pre = parse_vary("prealloc=on,off", scen)
    assert kv.values == [2.0, 4.0, 6.0, 8.0] and pre.values == [True, False]
    cell = cell_scenario(scen, [res, kv, pre], {"min_reserved_pages": 8, "kv_per_layer_mb": 6.0, "prealloc": False})
    vlm = next(e for e in cell.scenario.engines if e.name == "vlm")
    # min above the scenario's max (5): the max follows, and the cell says so
    assert vlm.sim.max_reserved_pages == 8 and cell.notes
    f = cell_features(cell.scenario, {"min_reserved_pages": 8}, environ={})
    assert f["vlm.pages_per_layer"] == 3 and f["vlm.min_reserved_pages"] == 8 and f["vlm.prealloc"] is False
    plan = SweepPlan([res, kv])
    assert plan.planned() == 40 and len(plan.take()) == 40


def test_bisection_finds_each_boundary_in_few_cells() -> None:
    scen, _, _ = load_scenario(None)
    res = parse_vary("engines.vlm.sim.min_reserved_pages=1..10", scen)
    kv = parse_vary("engines.vlm.sim.kv_per_layer_mb=2..40:2", scen, bisect=True)
    plan = SweepPlan([res, kv])
    ran = 0
    while batch := plan.take():
        for params in batch:
            ran += 1
            plan.record(params, int(params["kv_per_layer_mb"]) // 2 <= int(params["min_reserved_pages"]))
    assert ran < 80   # the full grid is 200
    assert [(b[0]["min_reserved_pages"], b[1], b[2]) for b in plan.boundaries()][:2] == [(1, 2.0, 4.0), (2, 4.0, 6.0)]


@pytest.mark.parametrize(("vary", "named"), [
    ("engines.vlm.sim.min_reserved_page=1..3", "'min_reserved_page'"),
    ("engines.nope.sim.layers=1,2", "'nope'"),
    ("bogus=1,2", "'bogus'"),
    ("engines.vlm.sim.layers=0", "layers"),
    ("prealloc=maybe", "'maybe'"),
])
def test_bad_vary_exits_2_naming_the_field(vary: str, named: str, tmp_path: Path) -> None:
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = main(["sweep", "--vary", vary, "--out", str(tmp_path / "s")])
    assert code == 2, out.getvalue()
    assert named in out.getvalue() and "Traceback" not in out.getvalue()
    assert not (tmp_path / "s" / "cells").exists()   # nothing ran


def test_unknown_field_error_lists_close_names() -> None:
    scen, _, _ = load_scenario(None)
    with pytest.raises(UsageError) as info:
        parse_vary("engines.vlm.sim.min_reserved_page=1", scen)
    assert "min_reserved_pages" in (info.value.hint or "")
