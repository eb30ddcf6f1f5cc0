"""`kvdiag report BUNDLE [--html FILE] [--out DIR]`: re-render a saved bundle, offline."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from kvdiag.analyze.diagnosis import complete
from kvdiag.bundle.io import atomic_write_text, load_run
from kvdiag.cli.common import result_console
from kvdiag.errors import ExitCode, UsageError
from kvdiag.report import run_view, write_view
from kvdiag.report.html import render_html
from kvdiag.report.terminal import render_terminal
from kvdiag.runs.sweep.session import is_sweep_folder, rerender_sweep


def report_cmd(
    bundle: Path = typer.Argument(..., help="A run folder, its bundle/ folder, or bundle.json."),
    html: Path | None = typer.Option(None, "--html", help="Write only the HTML page, to this file."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Folder for report.json/html/md "
                                    "(default: the run folder holding bundle/)"),
) -> int:
    """Re-render a saved bundle's report (HTML, JSON, Markdown) from the diagnosis stored in it.

    BUNDLE: a run folder, its bundle/ folder or a bundle.json. The report says what the run
    said (the stored diagnosis); a bundle without one is analyzed first.
    Exit codes: 0 written, 2 no readable bundle or an unwritable output.
    """
    if is_sweep_folder(bundle):   # a sweep's folder: its report.json is what it concluded
        for name, path in rerender_sweep(bundle, html, out).items():
            typer.echo(f"  {name}: {path}")
        return ExitCode.OK
    run = load_run(bundle)
    loaded, bundle_dir = run.bundle, run.bundle_dir
    # The stored diagnosis; a bundle written before diagnoses (or parts of them) were stored is judged now.
    diag = loaded.diagnosis = complete(loaded, run.run_bundles)
    con = result_console()
    paths: dict[str, Path]
    try:
        if html is not None:
            # Links in the page lead to the bundle's files from where the page is written.
            view = run_view(loaded, diag, out_dir=html.parent, bundle_dir=bundle_dir,
                            bundle_path=_relative_to(bundle_dir, html.parent))
            atomic_write_text(html, render_html(view))
            paths = {"report.html": html}
        else:
            # A bundle/ folder sits in its run folder: re-render there, beside it, like the original run.
            target = out if out is not None else run.out_dir
            view = run_view(loaded, diag, out_dir=target, bundle_dir=bundle_dir)
            paths = write_view(target, view)
    except OSError as exc:
        raise UsageError(f"cannot write the report: {exc.strerror or exc} ({exc.filename or ''})",
                         hint="pass --out DIR or --html FILE pointing at a writable place") from None
    render_terminal(view, con, paths)
    return ExitCode.OK


def _relative_to(path: Path, start: Path) -> str:
    try:
        return os.path.relpath(path.resolve(), start.resolve())
    except (ValueError, OSError):
        return str(path.resolve())


def register(app: typer.Typer) -> None:
    app.command("report")(report_cmd)
