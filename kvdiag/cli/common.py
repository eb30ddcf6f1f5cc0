"""Small helpers shared by command modules: the consoles, and a run's outcome on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from kvdiag.model.verdict import Diagnosis

if TYPE_CHECKING:   # only a type here: commands that never run engines (banner, doctor) stay light
    from kvdiag.runs.output import RunArtifacts

# The renderer is imported where it prints: a capture loads it beside its tools, not before them.


def console() -> Console:
    """Progress: stderr, so stdout carries only the outcome (``kvdiag repro ... > result.txt``)."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def result_console() -> Console:
    """The outcome: verdict, summary, the files written and the exit code, on stdout (every command)."""
    return Console(highlight=False, soft_wrap=True, markup=False)


class EarlyVerdict:
    """Prints a capture's verdict (its first two lines) as soon as the evidence is in, before the reports."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.text: str | None = None

    def __call__(self, diagnosis: Diagnosis) -> None:
        if self.as_json:
            return
        from kvdiag.report.terminal import verdict_head

        head = verdict_head(diagnosis.verdict)
        result_console().print(*head, sep="\n")
        self.text = "\n".join(t.plain for t in head)
        sys.stdout.flush()
        typer.echo("writing the report", err=True)


def print_outcome(arts: RunArtifacts, as_json: bool = False, said: str | None = None,
                  con: Console | None = None) -> int:
    """A run's outcome on stdout, every command's the same way (``said``: the verdict's head already printed;
    ``con``: another console, e.g. in tests): the report's terminal rendering, its files, the exit code."""
    if as_json:
        typer.echo(json.dumps({"verdict": arts.verdict.model_dump(mode="json"),
                               "verdicts_by_engine": {k: v.model_dump(mode="json")
                                                      for k, v in arts.verdicts_by_engine.items()},
                               "bundle": str(arts.out_dir / "bundle"),
                               "reports": {k: str(p) for k, p in arts.paths.items()},
                               "exit_code": arts.exit_code}, indent=2))
        return arts.exit_code
    con = con or result_console()
    if arts.view is None:
        raise ValueError("a run's outcome is printed from the view its report files were written from")
    from kvdiag.report.terminal import render_terminal

    render_terminal(arts.view, con, files=False, said=said)
    for name in ("report.html", "report.json", "report.md"):
        p = arts.paths.get(name) or (arts.out_dir / name)
        if Path(p).exists():
            con.print(f"  {name}: {p}")
    con.print(f"  bundle: {arts.out_dir / 'bundle'}")
    con.print(f"exit code {arts.exit_code}")
    sys.stdout.flush()
    return arts.exit_code
