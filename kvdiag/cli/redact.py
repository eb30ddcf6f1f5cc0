"""`kvdiag redact DIR`: check an output folder for secrets before attaching it anywhere.

Scans every file under DIR (bundle.json, raw tool outputs, logs, reports) with
the same rules kvdiag redacts with, and prints ``file:line: kind`` for each
credential-shaped value still there, never the value itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvdiag.errors import ExitCode, UsageError
from kvdiag.redact.files import scan_tree


def redact_cmd(
    folder: Path = typer.Argument(..., help="Output folder (or any folder) to scan."),
    as_json: bool = typer.Option(False, "--json", help="Print the findings as JSON."),
) -> int:
    """Check an output folder for secrets before attaching it anywhere.

    Prints file:line and kind of each credential-shaped value left, never the value.

    Exit codes: 0 nothing credential-shaped is left, 10 something is, 2 no such folder."""
    if not folder.exists():
        raise UsageError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise UsageError(f"{folder}: not a folder", hint="pass a run folder such as reports/capture-.../")
    hits = scan_tree(folder)
    files = sum(1 for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    code = ExitCode.DEADLOCK if hits else ExitCode.OK  # 10: the same "found it" code the checks use
    if as_json:
        typer.echo(json.dumps({"folder": str(folder), "files_scanned": files, "clean": not hits,
                               "findings": [{"path": h.path, "line": h.line, "kind": h.kind} for h in hits],
                               "exit_code": code}, indent=2))
        return code
    for h in hits:
        typer.echo(f"{h.path}:{h.line}: {h.kind}")
    if hits:
        typer.echo(f"{len(hits)} secret-looking value(s) left in {len({h.path for h in hits})} file(s) of {folder}; "
                   "do not attach it as is", err=True)
    else:
        typer.echo(f"{folder}: clean ({files} file(s) scanned, nothing credential-shaped found)")
    return code


def register(app: typer.Typer) -> None:
    app.command("redact")(redact_cmd)
