"""`kvdiag ab`: the same scenario with the stock and the fixed allocator, side by side."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli.common import console, print_outcome
from kvdiag.cli.sweep import print_result
from kvdiag.runs.outdir import prepare_out_dir
from kvdiag.runs.output import RunArtifacts
from kvdiag.runs.repro import launchable, run_ab
from kvdiag.runs.sweep.command import ab_repeat_config
from kvdiag.runs.sweep.execute import stderr_progress
from kvdiag.runs.sweep.session import run_sweep


def ab_cmd(
    scenario: Path | None = typer.Option(None, "--scenario", "-s",
                                         help="Scenario YAML (default: embedded two-engine)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: reports/ab-<timestamp>)."),
    repeat: int = typer.Option(1, "--repeat", "-n", min=1, max=1000,
                               help="Runs per allocator: each side becomes a rate k/N with a 95 % bound "
                                    "(\"fixed 0/10 hung, 95 % bound ≤ 31 %\"), run as a sweep over allocator."),
    jobs: int = typer.Option(0, "--jobs", "-j", min=0, max=64,
                             help="With --repeat: runs in parallel (0: min(CPUs + 1, 4))."),
) -> int:
    """Run a scenario with the stock and with the fixed allocator; compare both runs.

    Each side is a full run with its own report: OUT/stock/ and OUT/fixed/.
    OUT/report.html puts the two side by side, with links to each. With --repeat N each
    allocator runs N times (OUT/cells/<side>-<hash>/run-<i>/) and the report gives k/N and its bound.
    Exit codes: 0 fixed healthy and stock reproduced the hang,
    1 the A/B did not separate, 2 bad usage, 130 interrupted.
    """
    scen, name, text = launchable(scenario, "kvdiag ab")   # before any folder or engine exists
    if repeat > 1:
        cfg = ab_repeat_config(scen, name, text, out, repeat, jobs)
        return print_result(run_sweep(cfg, stderr_progress), cfg.out_dir)
    out_dir = prepare_out_dir(out, "ab")
    con = console()

    def said(side: str, arts: RunArtifacts) -> None:
        con.print(f"{side}: {arts.verdict.kind.value} — {arts.verdict.summary}")

    return print_outcome(run_ab(scen, name, text, out_dir, con, on_side=said))


def register(app: typer.Typer) -> None:
    app.command("ab")(ab_cmd)
