"""`kvdiag doctor [--scenario FILE] [--log LOG] [--json]`: this host and a planned setup against known risks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from kvdiag.report.doctor import render_doctor
from kvdiag.runs.doctor import doctor_report


def doctor_cmd(
    scenario: str | None = typer.Option(None, "--scenario", "-s", metavar="FILE",
                                        help="Scenario YAML to check as planned (`two-engine` = the embedded "
                                             "default)."),
    logs: list[Path] = typer.Option([], "--log", metavar="LOG",
                                    help="Engine log whose PageAllocator banners to check (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> int:
    """Check this host (GPUs, kvcached build, ptrace) and a planned setup against known kvcached risks.

    Exit codes: 0 no known risk applies, 10 at least one does, 2 bad usage or scenario.
    """
    report = doctor_report(scenario, list(logs))
    if as_json:
        typer.echo(json.dumps(report.model_dump(mode="json"), indent=2, ensure_ascii=False))
    else:
        # Piped into a file or a bug report: wide enough for the table to stay readable.
        wide = sys.stdout.isatty() or os.environ.get("COLUMNS")
        render_doctor(report, Console(highlight=False, soft_wrap=False, width=None if wide else 120))
    return report.exit_code


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_cmd)
