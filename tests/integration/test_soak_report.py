"""A soak's report leads with its results: figures with units and plots over time, on the first screen
(laid out by headless Chromium), from the bundle alone; the stall's summary counts what was in flight."""

from __future__ import annotations

import html
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cdp import evaluate
from kvcli import ROOT, read_report

pytestmark = pytest.mark.timeout(240)

SCREEN_W, SCREEN_H = 1280, 800


def _soak(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvdiag", "soak", "--concurrency", "16", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=150, cwd=ROOT)


@pytest.fixture(scope="module")
def stalled(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("soak") / "stock"
    run = _soak(out, "--duration", "20")
    assert run.returncode == 10, run.stderr[-2000:]
    return run, out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("soak") / "fixed"
    run = _soak(out, "--allocator", "fixed", "--duration", "6")
    assert run.returncode in (0, 6), run.stderr[-2000:]
    return run, out


def test_the_stall_summary_counts_the_requests_in_flight(stalled: tuple[subprocess.CompletedProcess[str], Path]
                                                         ) -> None:
    run, out = stalled
    soak = read_report(out)["soak"]
    assert isinstance(soak, dict) and soak["stalled"] and soak["in_flight_at_end"] == 16
    assert "16 in flight at the stall" in run.stdout.splitlines()[0]
    assert run.stdout.count("stall detected → verdict: ") == 1, run.stdout    # said once, in the verdict block
    assert len(soak["series"]) >= 4 and soak["series"][-1]["in_flight"] == 16
    md = (out / "report.md").read_text()
    assert "| requests | 0 ok · 0 failed (16 in flight at the stall) |" in md or "in flight at the stall" in md


def test_a_healthy_soak_says_what_the_load_showed(served: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    run, out = served
    verdict = read_report(out)["verdict"]
    assert isinstance(verdict, dict)
    if verdict["kind"] == "healthy":
        summary = verdict["summary"]
        assert "no stall in" in summary and "tok/s" in summary and "requests ok" in summary, summary
    # the same words everywhere: stdout, report.md, report.html
    # report.md escapes markup-like characters ("< 90%" reads "&lt; 90%" there): compare what it shows.
    assert verdict["summary"] in run.stdout and verdict["summary"] in html.unescape((out / "report.md").read_text())


def _cdp(browser: str, page: Path, expression: str, tmp_path: Path) -> object:
    return evaluate(browser, page, expression, tmp_path, (SCREEN_W, SCREEN_H))


_LAYOUT = """JSON.stringify({
  nav: [...document.querySelectorAll('nav.toc a')].map(a => a.getAttribute('href')),
  figures: [...document.querySelectorAll('#soak .figure')].map(f => ({
      text: f.innerText, bottom: f.getBoundingClientRect().bottom})),
  plots: [...document.querySelectorAll('#soak figure')].map(f => ({
      id: f.id, bottom: f.getBoundingClientRect().bottom, right: f.getBoundingClientRect().right,
      paths: f.querySelectorAll('svg path.series').length,
      marks: [...f.querySelectorAll('svg line.markline title')].map(t => t.textContent)})),
  external: [...document.querySelectorAll('[src],[href]')].map(e => e.getAttribute('src') || e.getAttribute('href'))
      .filter(u => /^(https?:)?\\/\\//.test(u)),
})"""


@pytest.mark.parametrize("which", ["stalled", "served"])
def test_first_screen_shows_the_figures_and_the_plots(which: str, request: pytest.FixtureRequest,
                                                      tmp_path: Path) -> None:
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                   None)
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    _, out = request.getfixturevalue(which)
    layout = _cdp(browser, out / "report.html", _LAYOUT, tmp_path)
    assert isinstance(layout, dict)
    assert layout["nav"][0] == "#soak"
    assert layout["external"] == []
    texts = " | ".join(f["text"] for f in layout["figures"])
    for want in ("tok/s", "TTFT", "ITL", " ms", "KV cache peak", "%", "saturat"):
        assert want in texts, (want, texts)
    assert all(f["bottom"] <= SCREEN_H for f in layout["figures"]), layout["figures"]
    plots = {p["id"]: p for p in layout["plots"]}
    assert set(plots) == {"soak-plot-tokens", "soak-plot-kv", "soak-plot-requests"}
    for p in plots.values():
        assert p["bottom"] <= SCREEN_H and p["right"] <= SCREEN_W, p
        assert p["paths"] >= 1, p
    if which == "stalled":
        assert "stall detected" in plots["soak-plot-tokens"]["marks"]
        assert "16 in flight at the stall" in texts


def test_the_live_line_never_shows_an_idle_servers_gauges_beside_requests_in_flight(
        served: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    run, _ = served
    live = [line for line in run.stderr.splitlines() if "| in flight " in line]
    assert live, run.stderr[-2000:]
    for line in live:
        in_flight = int(line.split("| in flight ", 1)[1].split()[0])
        if in_flight:
            assert "running 0 | waiting 0 | KV 0.0%" not in line, line
    assert "no /metrics scrape under load yet" in live[0] or "running " in live[0]
