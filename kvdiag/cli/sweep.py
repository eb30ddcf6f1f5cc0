"""`kvdiag sweep`: a scenario over a grid of settings (or bisected along one axis), repeated into rates;
the boundary stated as a rule and checked against the banner's static risk rule."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from kvdiag import defaults as D
from kvdiag.errors import UsageError
from kvdiag.launch.preflight import check_launchable
from kvdiag.model import SweepReport
from kvdiag.runs.lifecycle import switchable
from kvdiag.runs.output import default_out_dir
from kvdiag.runs.sweep.execute import stderr_progress
from kvdiag.runs.sweep.session import SweepConfig, run_sweep, stored_identity, summary_text
from kvdiag.scenario import load_scenario
from kvdiag.scenario.models import Scenario


def default_jobs() -> int:
    """One run more than CPUs: a hung run spends its stall window idle (benchmarks/results/sweep_jobs.txt)."""
    return max(1, min((os.cpu_count() or 1) + 1, D.SWEEP_MAX_JOBS))


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
    if resume and out is None:
        raise UsageError("--resume needs --out DIR (the folder of the sweep to continue)")
    if resume and not vary and bisect is None:
        if out is None:
            raise UsageError("--resume needs --out DIR")
        stored = stored_identity(out)
        if stored is None or stored.get("command") != "sweep":
            raise UsageError(f"{out} holds no sweep to resume", hint="start one with --vary FIELD=VALUES --out DIR")
        vary = [str(v) for v in stored.get("vary") or []]
        bisect = stored.get("bisect") if isinstance(stored.get("bisect"), str) else None
        repeat = int(stored.get("repeat") or 1)
        window = stored.get("stall_window_s")
        stall_window = float(window) if isinstance(window, (int, float)) else None
        name = str(stored.get("scenario") or "")
        kept = stored.get("engines")
        engines = ",".join(str(e) for e in kept) if isinstance(kept, list) else None
        scenario = None if name.startswith("<builtin>") else Path(name)
    elif not vary and bisect is None:
        raise UsageError("nothing to vary", hint="give --vary FIELD=VALUES, e.g. "
                                                 "--vary engines.vlm.sim.min_reserved_pages=1..10")
    scen, name, text = load_scenario(scenario)
    check_launchable(scen, name, text)   # once, before any cell: not the same refusal in every run
    if any(v.split("=", 1)[0].strip() == "allocator" for v in vary):
        switchable(scen, "kvdiag sweep --vary allocator=...")
    if stall_window is None:
        stall_window = min(D.SWEEP_STALL_WINDOW_S, scen.windows.stall_s)
    out_dir = out if out is not None else default_out_dir("sweep")
    cfg = SweepConfig(scenario=scen, scenario_name=name, scenario_text=text, out_dir=out_dir, vary=list(vary),
                      bisect=bisect, repeat=repeat,
                      engines=[e.strip() for e in engines.split(",") if e.strip()] if engines else None,
                      jobs=jobs or default_jobs(), stall_window_s=stall_window)
    report = run_sweep(cfg, stderr_progress)
    print_result(report, out_dir)
    return report.exit_code


def print_result(report: SweepReport, out_dir: Path) -> None:
    """Verdict and paths on stdout (progress went to stderr)."""
    typer.echo(summary_text(report))
    typer.echo(f"  report.html: {out_dir / 'report.html'}")
    typer.echo(f"  report.json: {out_dir / 'report.json'}")
    if report.interrupted:
        typer.echo(f"  interrupted: finished cells are kept; continue with: kvdiag sweep --resume --out {out_dir}")
    typer.echo(f"exit code {report.exit_code}")


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep_cmd)


def run_ab_repeat(scen: Scenario, name: str, text: str, out: Path | None, repeat: int, jobs: int) -> int:
    """`kvdiag ab --repeat N`: a sweep over allocator=stock,fixed, N runs each, judged as an A/B (the caller
    has refused scenarios whose allocator kvdiag cannot switch)."""
    out_dir = out if out is not None else default_out_dir("ab")
    cfg = SweepConfig(scenario=scen, scenario_name=name, scenario_text=text, out_dir=out_dir,
                      vary=["allocator=stock,fixed"], repeat=repeat, jobs=jobs or default_jobs(), command="ab")
    report = run_sweep(cfg, stderr_progress)
    print_result(report, out_dir)
    return report.exit_code
