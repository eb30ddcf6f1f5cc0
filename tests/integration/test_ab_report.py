"""`kvdiag ab`'s report is a side-by-side of its two runs: the A/B outcome on the verdict card, each
side's verdict and engine verdicts, links to each run's report and bundle, no raw JSON dump, and no
"deadlock risk" on the fixed allocator's engines.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from kvcli import assert_one_raw_layout, read_report, run_kvdiag

from kvdiag.model.report import Report
from kvdiag.model.verdict import ABComparison
from kvdiag.report.view import ab_view

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ab") / "out"
    proc = run_kvdiag("ab", "--out", str(out), timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _section(page: str, name: str) -> str:
    m = re.search(rf'<section id="{name}"[^>]*>(.*?)</section>', page, re.S)
    assert m, name
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", m.group(1))).split())


def test_verdict_card_says_the_ab_outcome(ab_run: Path) -> None:
    page = (ab_run / "report.html").read_text()
    assert '<section id="verdict" class="verdict ok">' in page
    card = _section(page, "verdict")
    assert "A/B separated" in card and "stock: gil_cycle" in card and "fixed: healthy" in card
    assert "<title>kvdiag A/B: separated</title>" in page


def test_both_runs_side_by_side_with_engine_verdicts_and_links(ab_run: Path) -> None:
    page = (ab_run / "report.html").read_text()
    sides = _section(page, "ab").split("Stock vs fixed allocator", 1)[1]
    stock, fixed = sides.split("fixed allocator", 1)
    assert "gil_cycle" in stock and "exit code 10" in stock
    assert re.search(r"vlm gil_cycle stalled no", stock) and re.search(r"coder healthy serving yes", stock)
    assert "exit code 0" in fixed
    assert re.search(r"coder healthy serving yes", fixed) and re.search(r"vlm healthy serving yes", fixed)
    # Engine verdicts in the engines table too (no "—" for any engine).
    engines = _section(page, "engines")
    for name, kind in (("stock/coder", "healthy"), ("stock/vlm", "gil_cycle"), ("fixed/coder", "healthy"),
                       ("fixed/vlm", "healthy")):
        assert re.search(rf"{re.escape(name)} http\S+ \w+ \w+ \w+ {kind}", engines), (name, engines[:800])
    # Links to each run's report and bundle, all resolving; every engine log link too.
    hrefs = [unquote(h) for h in re.findall(r'<a href="([^#"][^"]*)"', page)]
    for want in ("stock/report.html", "fixed/report.html", "stock/bundle/bundle.json", "fixed/bundle/bundle.json",
                 "stock/bundle/logs/vlm.log", "fixed/bundle/logs/coder.log"):
        assert want in hrefs, (want, hrefs)
    for h in hrefs:
        assert (ab_run / h).is_file(), h


def test_no_raw_dump_no_empty_capture_no_fixed_risk(ab_run: Path) -> None:
    page = (ab_run / "report.html").read_text()
    assert "No process was captured" not in _section(page, "processes")
    assert "stock/report.html" in _section(page, "processes")
    assert "file not in the bundle" not in page
    assert '"separated"' not in _section(page, "environment") and "{&#34;" not in page
    banners = _section(page, "banners")
    fixed_vlm = banners.split("fixed/vlm", 1)[1]
    assert fixed_vlm.split("·", 2)[2].strip().startswith("no risk"), fixed_vlm[:200]
    assert "no deadlock with the fixed allocator" in fixed_vlm
    assert "deadlock risk" in banners.split("fixed/", 1)[0]  # the stock vlm keeps its risk
    report = read_report(ab_run)
    assert not [f for f in report["findings"] if f["kind"] == "banner_risk"  # type: ignore[index]
                and str(f["engine"]).startswith("fixed/")]  # type: ignore[index]


def test_each_side_keeps_the_one_raw_layout(ab_run: Path) -> None:
    # ab nests two runs as bundles; the stock one hung and was captured, into raw/<pid>/ like every command
    assert assert_one_raw_layout(ab_run / "stock" / "bundle") >= 2
    assert_one_raw_layout(ab_run / "fixed" / "bundle")
    assert not (ab_run / "bundle" / "raw").exists()   # the A/B bundle holds no raw files of its own


def test_markdown_heads_with_the_ab_outcome(ab_run: Path) -> None:
    md = (ab_run / "report.md").read_text()
    assert md.splitlines()[0] == "### kvdiag: A/B separated (stock: `gil_cycle`, fixed: `healthy`)"
    rows = [line for line in md.splitlines() if line.startswith(("| stock |", "| fixed |"))]
    assert len(rows) == 2 and "stock/report.html" in rows[0] and "fixed/report.html" in rows[1]


def test_ab_view_reads_the_stored_comparison_shape() -> None:
    """The comparison as the bundle stores it (ABComparison: each side's bundle relative to the A/B bundle)."""
    side = {"verdict": "gil_cycle", "summary": "s", "exit_code": 10, "bundle": "../stock/bundle",
            "report": "stock/report.html", "engines": {"vlm": {"phase": "stalled", "healthy": False}}}
    fixed = dict(side, verdict="healthy", exit_code=0, bundle="../fixed/bundle", report="fixed/report.html")
    report = Report.model_validate({
        "kvdiag_version": "0", "command": "ab", "exit_code": 0,
        "verdict": {"kind": "gil_cycle", "summary": "x", "confidence": "high"},
        "verdicts_by_engine": {"stock": {"kind": "gil_cycle", "summary": "x", "confidence": "high", "engine": "vlm"},
                               "fixed": {"kind": "healthy", "summary": "y", "confidence": "high"}},
        "ab": {"stock": side, "fixed": fixed, "separated": True}, "bundle_path": "bundle"})
    view = ab_view(report)
    assert view is not None and view["separated"] and view["title"] == "A/B separated"
    stock_side, fixed_side = view["sides"]
    assert stock_side["bundle_href"] == "stock/bundle/bundle.json" and stock_side["report_href"] == "stock/report.html"
    assert stock_side["engines"][0]["verdict"] == "gil_cycle" and fixed_side["engines"][0]["verdict"] == "healthy"
    evil = dict(side, report="../../etc/passwd", bundle="/etc")
    report.ab = ABComparison.model_validate({"stock": evil, "fixed": fixed, "separated": False})
    view = ab_view(report)
    assert view is not None and view["sides"][0]["report_href"] is None and not view["separated"]


def test_report_rerenders_the_same_ab_page_from_the_bundle(ab_run: Path) -> None:
    before = (ab_run / "report.html").read_text()
    proc = run_kvdiag("report", str(ab_run), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = (ab_run / "report.html").read_text()
    for name in ("verdict", "ab", "engines", "processes"):
        assert _section(after, name) == _section(before, name), name


def test_ab_engines_keep_their_field_names_and_older_bundles_still_load(ab_run: Path, tmp_path: Path) -> None:
    """The typed A/B engines (ABEngine) write the same report.json/bundle.json fields as the dicts did, and
    a bundle written before the health line was stored (engines: phase, healthy, startup_s) re-renders."""
    import json
    import shutil

    report = read_report(ab_run)
    assert report["schema_version"] == "1"
    for label in ("stock", "fixed"):
        for info in report["ab"][label]["engines"].values():   # type: ignore[index]
            assert set(info) == {"phase", "healthy", "health", "startup_s"}, info
    old = tmp_path / "old"
    shutil.copytree(ab_run, old)
    data = json.loads((old / "bundle" / "bundle.json").read_text())
    for label in ("stock", "fixed"):
        for info in data["diagnosis"]["ab"][label]["engines"].values():
            del info["health"]            # the older shape
    (old / "bundle" / "bundle.json").write_text(json.dumps(data))
    proc = run_kvdiag("report", str(old), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before = (ab_run / "report.html").read_text()
    after = (old / "report.html").read_text()
    assert _section(after, "ab") == _section(before, "ab")
    # A report.json from before the side's bundle folder was kept (no "bundle") still parses and renders.
    doc = read_report(ab_run)
    for label in ("stock", "fixed"):
        del doc["ab"][label]["bundle"]    # type: ignore[index]
    view = ab_view(Report.model_validate(doc))
    assert view is not None and [s["bundle"] for s in view["sides"]] == ["stock/bundle", "fixed/bundle"]


def test_one_outcome_everywhere_analyze_report_json_and_pages(ab_run: Path) -> None:
    # The A/B's outcome (and ab's exit code), never the stock side's gil_cycle as the run's verdict.
    analyzed = run_kvdiag("analyze", str(ab_run), timeout=120)
    assert analyzed.returncode == 0, analyzed.stderr
    assert analyzed.stdout.splitlines()[0] == "outcome: A/B separated (stock: gil_cycle, fixed: healthy)  exit 0"
    rendered = run_kvdiag("report", str(ab_run), timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    assert "A/B separated (stock: gil_cycle, fixed: healthy)  exit 0" in rendered.stdout
    assert not rendered.stdout.split("\n", 2)[1].startswith("verdict")
    report = read_report(ab_run)
    assert (report["outcome"], report["exit_code"]) == ("ab_separated", 0)
    assert (ab_run / "report.md").read_text().startswith("### kvdiag: A/B separated")
    assert report["simulated_engines"] == ["stock/coder", "stock/vlm", "fixed/coder", "fixed/vlm"]
