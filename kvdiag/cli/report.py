"""`kvdiag report BUNDLE [--html FILE] [--out DIR]`: re-render a saved bundle, offline."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from pydantic import ValidationError

from kvdiag.bundle_io import atomic_write_text, load_bundle
from kvdiag.errors import ExitCode, KvdiagError
from kvdiag.model import Bundle, Confidence, Verdict, VerdictKind


def _verdicts(bundle: Bundle, bundle_dir: Path) -> tuple[Verdict, dict[str, Verdict]]:
    """Re-run the analyzer; without one, reuse the verdict saved next to the bundle."""
    try:
        from kvdiag.analyze import analyze, analyze_by_engine
    except ImportError:
        pass
    else:
        return analyze(bundle), analyze_by_engine(bundle)
    saved = bundle_dir.parent / "report.json"
    if saved.is_file():
        try:
            data = json.loads(saved.read_text(encoding="utf-8"))
            verdict = Verdict.model_validate(data["verdict"])
            by_engine = {str(k): Verdict.model_validate(v)
                         for k, v in (data.get("verdicts_by_engine") or {}).items()}
            return verdict, by_engine
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ValidationError):
            pass
    return Verdict(kind=VerdictKind.UNKNOWN, confidence=Confidence.LOW,
                   summary="no analyzer available and no saved verdict: showing the captured evidence only"), {}


def _exit_code_for(verdict: Verdict) -> int:
    """The exit code the original command would have returned for this verdict (shown in the report)."""
    if verdict.kind.is_hang:
        return ExitCode.DEADLOCK
    if verdict.kind in (VerdictKind.CRASH, VerdictKind.OOM):
        return ExitCode.ENGINE_FAILED
    return ExitCode.OK if verdict.kind is VerdictKind.HEALTHY else ExitCode.FAILED


def report_cmd(
    bundle: Path = typer.Argument(..., help="A run folder, its bundle/ folder, or bundle.json."),
    html: Path | None = typer.Option(None, "--html", help="Write only the HTML page, to this file."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Folder for report.json/html/md "
                                    "(default: the run folder holding bundle/)"),
) -> int:
    """Re-analyze a saved bundle and re-render its report (HTML, JSON, Markdown); exit 0."""
    from kvdiag.cli.common import console
    from kvdiag.report import build_report, render_html, render_terminal, write_outputs

    loaded, bundle_dir = load_bundle(bundle)
    verdict, by_engine = _verdicts(loaded, bundle_dir)
    command = loaded.command or "report"
    code = _exit_code_for(verdict)
    con = console()
    paths: dict[str, Path]
    try:
        if html is not None:
            report = build_report(loaded, verdict, command=command, exit_code=code, verdicts_by_engine=by_engine,
                                  bundle_path=str(bundle_dir))
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
        raise KvdiagError(f"cannot write the report: {exc.strerror or exc} ({exc.filename or ''})",
                          hint="pass --out DIR or --html FILE pointing at a writable place") from None
    render_terminal(report, con, paths)
    return ExitCode.OK


def register(app: typer.Typer) -> None:
    app.command("report")(report_cmd)
