"""Report stage: render a bundle and its verdict as report.json, report.html, report.md and a terminal summary.

Reporters only render: they read the typed model (and raw files in the
bundle folder), never run tools or analyzers. What they render was redacted
where it entered (:mod:`kvdiag.redact`): the bundle when it was written or
loaded, :func:`write_outputs`' inputs once, raw files as they are read; every
file is written atomically.
"""

from __future__ import annotations

import html as _html
import os
from pathlib import Path

from kvdiag.bundle import atomic_write_text
from kvdiag.model import ABComparison, Bundle, Finding, Report, Verdict
from kvdiag.redact import redact_bundle
from kvdiag.report.html import render_html
from kvdiag.report.json import build_report, render_json
from kvdiag.report.markdown import render_markdown
from kvdiag.report.redact import REDACTED, is_secret_name, redact_obj, redact_text
from kvdiag.report.terminal import render_terminal

__all__ = [
    "REDACTED", "build_report", "is_secret_name", "redact_obj", "redact_text", "render_html", "render_json",
    "render_markdown", "render_run", "render_terminal", "write_outputs",
]

REPORT_FILES = ("report.json", "report.html", "report.md")


def _fallback_html(report: Report, error: str) -> str:
    esc = _html.escape
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'\">"
            f"<title>kvdiag report: {esc(report.verdict.kind.value)}</title></head><body>"
            f"<h1>{esc(report.verdict.kind.value)}</h1><p>{esc(report.verdict.summary)}</p>"
            f"<p>The full page could not be rendered ({esc(error)}); see report.json.</p></body></html>\n")


def _relative(path: Path, start: Path) -> str:
    try:
        return os.path.relpath(path, start)
    except ValueError:  # another drive (Windows); keep it absolute
        return str(path)


def write_outputs(out_dir: Path, bundle: Bundle, verdict: Verdict, *, command: str, exit_code: int,
                  verdicts_by_engine: dict[str, Verdict] | None = None,
                  ab: ABComparison | None = None, bundle_dir: Path | None = None) -> dict[str, Path]:
    """Write out_dir/report.json, report.html and report.md (redacted, each atomically).

    Works on a partial bundle (an interrupted run). A renderer that fails gets
    a minimal fallback page and a ``report_render_failed`` finding in
    report.json, so a run never ends without a readable report. Returns
    ``{"report.json": path, "report.html": path, "report.md": path}``.
    ``bundle_dir`` (default ``out_dir/bundle``) is where raw tool outputs and
    logs are read from.
    """
    if bundle_dir is None:
        bundle_dir = out_dir / "bundle"
    has_bundle_dir = bundle_dir.is_dir()
    # The report stage's one redaction: its inputs, once (the bundle is normally redacted already, where
    # its data entered it; a caller may hand anything). Renderers below do not redact again.
    bundle = redact_bundle(bundle)
    verdict, verdicts_by_engine, ab, command = redact_obj((verdict, verdicts_by_engine, ab, command))
    report = build_report(bundle, verdict, command=command, exit_code=exit_code,
                          verdicts_by_engine=verdicts_by_engine, ab=ab,
                          bundle_path=_relative(bundle_dir, out_dir) if has_bundle_dir else None)
    failures: list[Finding] = []
    try:
        page = render_html(report, bundle, bundle_dir if has_bundle_dir else None)
    except Exception as exc:  # a rendering bug must not cost the user the report
        failures.append(Finding(kind="report_render_failed", message=f"report.html: {type(exc).__name__}: {exc}"))
        page = _fallback_html(report, f"{type(exc).__name__}: {exc}")
    try:
        markdown = render_markdown(report, bundle)
    except Exception as exc:
        failures.append(Finding(kind="report_render_failed", message=f"report.md: {type(exc).__name__}: {exc}"))
        markdown = f"### kvdiag: `{report.verdict.kind.value}`\n\n{report.verdict.summary}\n"
    if failures:
        report.findings.extend(failures)
    paths = {name: out_dir / name for name in REPORT_FILES}
    # JSON first: it is the contract and the cheapest to get right.
    atomic_write_text(paths["report.json"], render_json(report))
    atomic_write_text(paths["report.md"], markdown)
    atomic_write_text(paths["report.html"], page)
    return paths


def render_run(out_dir: Path, bundle: Bundle, bundle_dir: Path | None = None) -> dict[str, Path]:
    """Render the diagnosis stored in ``bundle`` (``bundle.diagnosis``) as report.json/html/md."""
    diag = bundle.diagnosis
    if diag is None:
        raise ValueError("the bundle holds no diagnosis: analyze it first (kvdiag.analyze.diagnose)")
    return write_outputs(out_dir, bundle, diag.verdict, command=bundle.command, exit_code=diag.exit_code,
                         verdicts_by_engine=diag.verdicts_by_engine,
                         ab=diag.ab, bundle_dir=bundle_dir)
