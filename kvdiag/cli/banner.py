"""`kvdiag banner LOGFILE|-`: parse PageAllocator banners and print the static risk check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from kvdiag.errors import ExitCode
from kvdiag.kvcached.banner import assess_risk_for, parse_banners
from kvdiag.kvcached.defects import FIX_BUILD, GIL_HOLDING_ALLOC_PAGE
from kvdiag.logs.lines import read_log_lines


def banner_cmd(
    logfile: str = typer.Argument(..., help="Log file to scan, or - for standard input."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> int:
    """Check a log's kvcached "Init C++ PageAllocator" banners for the prealloc deadlock.

    LOGFILE: an engine's log, or - for standard input. Each banner is printed
    with its pages per layer; enable_prealloc=1 with at most min_reserved_pages
    pages per layer hangs at start-up (kvcached #371); with a bigger pool, prealloc
    on still hangs once load fills the pool, unless kvcached has the #422 fix
    (`kvdiag doctor` judges the installed build).
    Exit codes: 0 no banner leaves the deadlock open (prealloc off), 10 one does,
    5 the input holds no banner (nothing judged), 2 unreadable log.
    """
    if logfile == "-":
        lines = sys.stdin.read().splitlines()
        source = "<stdin>"
    else:
        lines = read_log_lines(Path(logfile))
        source = logfile
    banners = parse_banners(lines, source)
    risks = [assess_risk_for(b, None) for b in banners]
    under_load = [r.load_risk for r in risks]
    risky = any(r.at_risk for r in risks)
    if as_json:
        typer.echo(json.dumps({"banners": [b.model_dump(mode="json") for b in banners],
                               "risks": [r.model_dump(mode="json") for r in risks],
                               "load_risks": under_load, "risky": risky}, indent=2))
    else:
        if not banners:
            typer.echo(f"{source}: no 'Init C++ PageAllocator' banner found: nothing judged (exit 5)")
        for b, r, later in zip(banners, risks, under_load, strict=True):
            typer.echo(f"line {b.line_no}: group_id={b.group_id} num_layers={b.num_layers} "
                       f"mem_size_per_layer={b.mem_size_per_layer_mb}MB page_size={b.page_size_mb}MB "
                       f"pages/layer={r.pages_per_layer} enable_prealloc={int(b.enable_prealloc)} "
                       f"min_reserved={b.min_reserved_pages} max_reserved={b.max_reserved_pages}")
            for reason in r.reasons:
                typer.echo(f"  RISK at start-up: {reason}")
            if later and not r.risky:
                typer.echo(f"  RISK under load: {later}")
            if r.risky or later:
                typer.echo(f"  workaround: {GIL_HOLDING_ALLOC_PAGE.workaround}, or {FIX_BUILD}")
            else:
                typer.echo("  no deadlock risk from this banner (prealloc off: no prealloc worker)")
    if not banners:
        return ExitCode.NOT_DIAGNOSABLE     # nothing to judge: "no risk" would be a false all-clear
    return ExitCode.DEADLOCK if risky else ExitCode.OK


def register(app: typer.Typer) -> None:
    app.command("banner")(banner_cmd)
