"""`kvdiag analyze BUNDLE [--json]`: re-analyze a saved bundle offline."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvdiag.analyze import analyze, analyze_by_engine, exit_code_for
from kvdiag.analyze.text import format_verdict
from kvdiag.bundle_io import load_bundle


def analyze_cmd(
    bundle: Path = typer.Argument(..., help="A run folder, its bundle/ folder, or bundle.json."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as JSON."),
) -> int:
    """Re-analyze a saved bundle offline; print the verdict and the frames behind it.

    BUNDLE: a run folder, its bundle/ folder or a bundle.json (e.g. from a bug).
    Nothing is captured again and no file is written (kvdiag report re-renders).
    Exit codes: 0 no hang evidence, 10 deadlock or stall, 4 crash or OOM,
    2 no readable bundle.
    """
    loaded, bundle_dir = load_bundle(bundle)
    verdict = analyze(loaded)
    by_engine = analyze_by_engine(loaded)
    code = exit_code_for(verdict)
    if as_json:
        typer.echo(json.dumps({"verdict": verdict.model_dump(mode="json"),
                               "verdicts_by_engine": {k: v.model_dump(mode="json") for k, v in by_engine.items()},
                               "bundle": str(bundle_dir), "exit_code": code}, indent=2))
    else:
        typer.echo(format_verdict(verdict, by_engine))
        typer.echo(f"bundle: {bundle_dir}")
        typer.echo(f"exit code {code}")
    return code


def register(app: typer.Typer) -> None:
    app.command("analyze")(analyze_cmd)
