"""One judgement of a banner everywhere: an engine's banner column says what `kvdiag banner` says of the same
banner (a soak engine with prealloc on read "ok" in every report while `kvdiag banner` called it RISK under load)."""

from __future__ import annotations

import io
from pathlib import Path

from reportkit import view_of
from rich.console import Console

from kvdiag.analyze.diagnosis import diagnose
from kvdiag.bundle.io import load_bundle
from kvdiag.kvcached.banner import assess_risk_for
from kvdiag.report.html import render_html
from kvdiag.report.json import report_of
from kvdiag.report.markdown import render_markdown
from kvdiag.report.terminal import render_terminal

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


def test_an_engines_banner_column_is_the_banner_commands_judgement() -> None:
    bundle = load_bundle(BUNDLES / "soak_gil_cycle")[0]
    engine = bundle.engines[0]
    assert engine.banners and engine.banners[0].enable_prealloc
    alone = assess_risk_for(engine.banners[0], None)   # what `kvdiag banner` judges from the log line
    assert alone.label == "RISK under load"
    diag = diagnose(bundle)
    judged = next(e for e in diag.engines or [] if e.name == engine.name)
    assert judged.banner_risk is not None and judged.banner_risk.label == alone.label, judged.banner_risk
    view = view_of(report_of(bundle, diag, command="soak"), bundle)
    out = io.StringIO()
    render_terminal(view, Console(file=out, width=200))
    row = next(line for line in out.getvalue().splitlines() if line.startswith(f"{engine.name} "))
    assert row.rstrip().endswith("RISK@load"), row
    html = render_html(view).split('id="kvdiag-report"')[0]
    assert '<span class="badge bad">RISK under load</span>' in html
    md = render_markdown(view)
    assert "**RISK under load**" in md
