"""`kvdiag sweep`: a scenario over a grid of settings (or bisected along one axis), repeated into rates;
the boundary stated as a rule and checked against the banner's static risk rule."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag import defaults as D
from kvdiag.model.sweep import SweepReport
from kvdiag.report.sweep import render_sweep_text
from kvdiag.report.sweepview import sweep_view
from kvdiag.runs.sweep.command import sweep_config
from kvdiag.runs.sweep.execute import stderr_progress
from kvdiag.runs.sweep.session import run_sweep


def sweep_cmd(
    vary: list[str] = typer.Option([], "--vary", "-v", metavar="FIELD=VALUES",
                                   help="A field and its values: engines.vlm.sim.min_reserved_pages=1..10, "
                                        "engines.vlm.sim.kv_per_layer_mb=2..40:2, prealloc=on,off, "
                                        "allocator=stock,fixed, env.NAME=a,b, engines.NAME.env.VAR=a,b. "
                                        "Repeat for a grid."),
    bisect: str | None = typer.Option(None, "--bisect", metavar="FIELD=LO..HI",
                                      help="A numeric field searched for its boundary (its ends, then halving "
                                           "where the outcome changes) for every setting of the --vary fields."),
    scenario: Path | None = typer.Option(None, "--scenario", "-s",
                                         help="Scenario YAML (default: embedded two-engine)."),
    repeat: int = typer.Option(1, "--repeat", "-n", min=1, max=1000,
                               help="Runs per cell: each cell becomes a rate k/N with a 95 % interval."),
    jobs: int = typer.Option(0, "--jobs", "-j", min=0, max=64,
                             help=f"Runs in parallel (0: min(CPUs + 1, {D.SWEEP_MAX_JOBS})); runs sharing a named "
                                  "device or a fixed port never overlap."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: reports/sweep-<timestamp>)."),
    resume: bool = typer.Option(False, "--resume",
                                help="Continue the sweep stored in --out (its fields, values and scenario)."),
    engines: str | None = typer.Option(None, "--engines", metavar="NAME,...",
                                       help="Start only these engines of the scenario in every cell (a "
                                            "start_after on a left-out engine is dropped): faster cells when the "
                                            "others do not take part in the hang."),
    stall_window: float | None = typer.Option(None, "--stall-window", min=0.2, max=3600,
                                              help=f"Each cell's stall window in seconds (default "
                                                   f"{D.SWEEP_STALL_WINDOW_S:g}, or the scenario's if shorter)."),
) -> int:
    """Run a scenario over a grid of settings; find where it hangs and state the boundary as a rule.

    Every run is a full `kvdiag repro` (capture and verdict included) in OUT/cells/<cell>/run-<i>/.
    Finished cells are kept: run the same command again (or --resume --out OUT) after an interrupt.
    Exit codes: 0 finished, no cell hung · 10 some cell hung · 1 a run failed to run ·
    2 bad usage · 130 interrupted.
    """
    cfg = sweep_config(vary=list(vary), bisect=bisect, scenario=scenario, repeat=repeat, jobs=jobs, out=out,
                       resume=resume, engines=engines, stall_window=stall_window)
    return print_result(run_sweep(cfg, stderr_progress), cfg.out_dir)


def print_result(report: SweepReport, out_dir: Path) -> int:
    """Verdict and paths on stdout (progress went to stderr)."""
    typer.echo(render_sweep_text(sweep_view(report)))
    typer.echo(f"  report.html: {out_dir / 'report.html'}")
    typer.echo(f"  report.json: {out_dir / 'report.json'}")
    if report.interrupted:
        typer.echo(f"  interrupted: finished cells are kept; continue with: kvdiag sweep --resume --out {out_dir}")
    typer.echo(f"exit code {report.exit_code}")
    return report.exit_code


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep_cmd)
