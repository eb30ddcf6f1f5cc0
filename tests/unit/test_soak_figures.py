"""Soak figures agree with each other: the live rate is over a window (never 0 tok/s while tokens flowed),
shows the running total the summary counts, and a stalled engine is never reported healthy.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

from reportkit import build_report, view_of
from rich.console import Console

from kvdiag.analyze.overall import analyze, analyze_by_engine
from kvdiag.load.progress import ProgressView
from kvdiag.model.bundle import Bundle
from kvdiag.report.markdown import render_markdown
from kvdiag.report.terminal import render_terminal

BUNDLE = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "soak_gil_cycle" / "bundle.json"


def _lg(tokens: int) -> SimpleNamespace:
    return SimpleNamespace(tokens=tokens, in_flight=32, ok=0, failed=0, timed_out=0)


def test_live_rate_is_over_a_window_and_never_zero_while_tokens_flow() -> None:
    view = ProgressView(Console(file=io.StringIO()), window_s=5.0)
    tokens = 0
    rates: list[tuple[float, float]] = []
    # Bursty streams: 900 tokens land once a second; the view redraws every 0.1 s.
    for step in range(1, 121):
        t = step / 10
        if step % 10 == 0:
            tokens += 900
        text = view.line(t, _lg(tokens), None, 0.0)  # type: ignore[arg-type]
        assert f"{tokens} tokens" in text
        rates.append((t, view.rate))
    after_first_burst = [r for t, r in rates if t >= 1.0]
    assert min(after_first_burst) > 0, "0 tok/s shown while tokens flowed"
    steady = [r for t, r in rates if t >= 6.0]
    assert all(700 <= r <= 1100 for r in steady), steady  # 900 tok/s on average, within a burst


def test_live_rate_falls_to_zero_only_after_a_whole_window_without_tokens() -> None:
    view = ProgressView(Console(file=io.StringIO()), window_s=5.0)
    for step in range(0, 101):  # 10 s of 1000 tok/s
        view.line(step / 10, _lg(step * 100), None, 0.0)  # type: ignore[arg-type]
    stalled_at = 10000
    seen = []
    for step in range(101, 181):  # then nothing for 8 s
        view.line(step / 10, _lg(stalled_at), None, 0.0)  # type: ignore[arg-type]
        seen.append((step / 10, view.rate))
    assert all(r > 0 for t, r in seen if t < 14.9)
    assert all(r == 0 for t, r in seen if t >= 15.1)


def test_a_stalled_engine_is_not_reported_healthy_even_if_health_answered() -> None:
    bundle = Bundle.model_validate(json.loads(BUNDLE.read_text()))
    engine = bundle.engines[0]
    assert engine.phase.value == "stalled" and engine.healthy  # /health answered after the decode stall
    verdict = analyze(bundle)
    report = build_report(bundle, verdict, command="soak", exit_code=10, verdicts_by_engine=analyze_by_engine(bundle))
    entry = report.engines[0]
    assert entry.phase.value == "stalled" and entry.healthy is False and entry.health_endpoint_ok is True
    out = io.StringIO()
    render_terminal(view_of(report), Console(file=out, width=200))
    row = next(line for line in out.getvalue().splitlines() if line.startswith("hybrid ") and "stock" in line)
    # the health line names the verdict and what /health said (kvdiag.model.health)
    why = verdict.kind.value.replace("_", " ")
    assert "stalled" in row and entry.health == f"no ({why}; /health still answered)"
    assert " yes " not in row
    md = render_markdown(view_of(report))
    md_row = next(line for line in md.splitlines() if line.startswith("| hybrid | stock |"))
    assert f"| stalled | {entry.health} |" in md_row


def test_summary_rate_is_labelled_an_average_over_the_load() -> None:
    from kvdiag.model.run import SoakStats
    from kvdiag.report.soakview import soak_lines

    stats = SoakStats(requests_ok=10, tokens=3191, duration_s=10.0, drain_s=0.5)
    first = soak_lines(stats)[0]
    assert "3191 tokens, avg 304 tok/s over 10.5 s" in first, first
