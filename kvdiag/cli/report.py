"""`kvdiag report BUNDLE [--html FILE] [--out DIR]`: re-render a saved bundle, offline."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from kvdiag.analyze import analyze, analyze_by_engine, exit_code_for
from kvdiag.bundle_io import atomic_write_text, load_bundle
from kvdiag.errors import ExitCode, UsageError


def report_cmd(
    bundle: Path = typer.Argument(..., help="A run folder, its bundle/ folder, or bundle.json."),
    html: Path | None = typer.Option(None, "--html", help="Write only the HTML page, to this file."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Folder for report.json/html/md "
                                    "(default: the run folder holding bundle/)"),
) -> int:
    """Re-analyze a saved bundle and re-render its report (HTML, JSON, Markdown).

    BUNDLE: a run folder, its bundle/ folder or a bundle.json.
    Exit codes: 0 written, 2 no readable bundle or an unwritable output.
    """
    from kvdiag.cli.common import console
    from kvdiag.report import build_report, render_html, render_terminal, write_outputs

    loaded, bundle_dir = load_bundle(bundle)
    verdict, by_engine = analyze(loaded), analyze_by_engine(loaded)
    command = loaded.command or "report"
    code = exit_code_for(verdict)
    con = console()
    paths: dict[str, Path]
    try:
        if html is not None:
            # Links in the page lead to the bundle's files from where the page is written.
            report = build_report(loaded, verdict, command=command, exit_code=code, verdicts_by_engine=by_engine,
                                  bundle_path=_relative_to(bundle_dir, html.parent))
            atomic_write_text(html, render_html(report, loaded, bundle_dir))
            paths = {"report.html": html}
        else:
            # A bundle/ folder sits in its run folder: re-render there, beside it, like the original run.
            target = out if out is not None else (bundle_dir.parent if bundle_dir.name == "bundle" else bundle_dir)
            paths = write_outputs(target, loaded, verdict, command=command, exit_code=code,
                                  verdicts_by_engine=by_engine, bundle_dir=bundle_dir)
            report = build_report(loaded, verdict, command=command, exit_code=code, verdicts_by_engine=by_engine,
                                  bundle_path=str(bundle_dir))
    except OSError as exc:
        raise UsageError(f"cannot write the report: {exc.strerror or exc} ({exc.filename or ''})",
                         hint="pass --out DIR or --html FILE pointing at a writable place") from None
    render_terminal(report, con, paths)
    return ExitCode.OK


def _relative_to(path: Path, start: Path) -> str:
    try:
        return os.path.relpath(path.resolve(), start.resolve())
    except (ValueError, OSError):
        return str(path.resolve())


def register(app: typer.Typer) -> None:
    app.command("report")(report_cmd)
