"""`kvdiag analyze BUNDLE [--json]`: re-analyze a saved bundle offline."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvdiag.analyze.diagnosis import diagnose
from kvdiag.bundle.io import load_run, resolve_bundle_file
from kvdiag.cli.common import result_console
from kvdiag.errors import UsageError
from kvdiag.report import run_view
from kvdiag.report.terminal import render_terminal
from kvdiag.runs.sweep.session import is_sweep_folder


def analyze_cmd(
    bundle: Path = typer.Argument(..., help="A run folder, its bundle/ folder, or bundle.json."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as JSON."),
) -> int:
    """Re-analyze a saved bundle offline; print the verdict and the frames behind it.

    BUNDLE: a run folder, its bundle/ folder or a bundle JSON file under any name (e.g. from a bug); an A/B folder
    is judged from its two nested runs. Nothing is captured again and no file is written
    (kvdiag report re-renders). The diagnosis is recomputed from the bundle alone; --json says
    whether it agrees with the one the run stored.
    Exit codes: as kvdiag capture: 0 no hang evidence, 10 deadlock or stall, 4 crash or OOM,
    3 no access, 5 nothing to judge, 6 inconclusive; 2 no readable bundle (an A/B folder: as
    kvdiag ab; a soak: 6 also when the KV cache never got near full; an interrupted run: 130).
    """
    if is_sweep_folder(bundle):   # many runs, each with its own bundle: say which to pass
        first = next((d for d in sorted(bundle.glob("cells/*/run-*")) if d.is_dir()), None)
        raise UsageError(f"{bundle}: a sweep's (or ab --repeat's) folder holds one bundle per run, not one to analyze",
                         hint=(f"analyze one run, e.g. kvdiag analyze {first}; " if first else "")
                         + f"kvdiag report {bundle} re-renders its page")
    run = load_run(bundle)
    diag = diagnose(run.bundle, run.run_bundles)
    stored = run.bundle.diagnosis
    agrees = None if stored is None else (stored.verdict.kind, stored.exit_code) == (diag.verdict.kind, diag.exit_code)
    if as_json:
        typer.echo(json.dumps({"outcome": diag.ab.outcome if diag.ab is not None else diag.verdict.kind.value,
                               "verdict": diag.verdict.model_dump(mode="json"),
                               "verdicts_by_engine": {k: v.model_dump(mode="json")
                                                      for k, v in diag.verdicts_by_engine.items()},
                               "ab": diag.ab.model_dump(mode="json") if diag.ab is not None else None,
                               "notes": diag.notes, "bundle": str(resolve_bundle_file(bundle)),
                               "exit_code": diag.exit_code,
                               "agrees_with_run": agrees}, indent=2))
    else:
        con = result_console()
        render_terminal(run_view(run.bundle, diag, out_dir=run.out_dir), con, files=False)
        for note in diag.notes:
            con.print(f"note: {note}")
        if agrees is False and stored is not None:
            con.print(f"note: the run itself said {stored.verdict.kind.value} (exit {stored.exit_code})")
        con.print(f"bundle: {resolve_bundle_file(bundle)}")
        con.print(f"exit code {diag.exit_code}")
    return diag.exit_code


def register(app: typer.Typer) -> None:
    app.command("analyze")(analyze_cmd)
