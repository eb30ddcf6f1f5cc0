"""Small helpers shared by command modules (console, summary printing, reading a log)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from kvdiag.model import Diagnosis

if TYPE_CHECKING:   # only a type here: commands that never run engines (banner, doctor) stay light
    from kvdiag.runs.output import RunArtifacts

# The renderers are imported where they print: a capture loads them beside its tools, not before them.


def console() -> Console:
    """Progress: stderr, so stdout carries only the outcome (``kvdiag repro ... > result.txt``)."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def result_console() -> Console:
    """The outcome: verdict, summary, the files written and the exit code, on stdout (every command)."""
    return Console(highlight=False, soft_wrap=True)


def print_summary(arts: RunArtifacts, con: Console | None = None) -> None:
    """The run's outcome on stdout (``con``: another console, e.g. in tests)."""
    from kvdiag.report.terminal import render_terminal

    con = con or result_console()
    if arts.view is None:
        raise ValueError("a run's outcome is printed from the view its report files were written from")
    render_terminal(arts.view, con, files=False)
    for name in ("report.html", "report.json", "report.md"):
        p = arts.paths.get(name) or (arts.out_dir / name)
        if Path(p).exists():
            con.print(f"  {name}: {p}")
    con.print(f"  bundle: {arts.out_dir / 'bundle'}")
    con.print(f"exit code {arts.exit_code}")
    sys.stdout.flush()


class EarlyVerdict:
    """Prints a capture's verdict (its first two lines) as soon as the evidence is in, before the reports."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.text: str | None = None

    def __call__(self, diagnosis: Diagnosis) -> None:
        from kvdiag.report.text import format_verdict

        if self.as_json:
            return
        self.text = format_verdict(diagnosis.verdict)
        typer.echo("\n".join(self.text.splitlines()[:2]), nl=True)
        sys.stdout.flush()
        typer.echo("writing the report", err=True)


def print_outcome(arts: RunArtifacts, as_json: bool, said: str | None = None) -> int:
    """A capture's outcome on stdout; ``said``: the verdict already printed (its lines are not repeated)."""
    from kvdiag.report.text import format_verdict

    verdict, by_engine, code, paths = arts.verdict, arts.verdicts_by_engine, arts.exit_code, arts.paths
    bundle_dir = arts.out_dir / "bundle"
    if as_json:
        typer.echo(json.dumps({"verdict": verdict.model_dump(mode="json"),
                               "verdicts_by_engine": {k: v.model_dump(mode="json") for k, v in by_engine.items()},
                               "bundle": str(bundle_dir), "reports": {k: str(p) for k, p in paths.items()},
                               "exit_code": code}, indent=2))
        return code
    text = format_verdict(verdict, by_engine).splitlines()
    if said and said.splitlines()[:2] == text[:2]:
        text = text[2:]   # the verdict line and its summary are on the screen already
    typer.echo("\n".join(text))
    typer.echo(f"bundle: {bundle_dir}")
    for name, path in paths.items():
        typer.echo(f"{name}: {path}")
    typer.echo(f"exit code {code}")
    return code
