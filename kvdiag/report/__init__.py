"""Report stage: render a bundle and its stored diagnosis as report.json, report.html, report.md and a
terminal summary.

A run's report is built once (:func:`run_view`) into a :class:`ReportView`, and every renderer reads
that view: they never run tools or analyzers, never judge or match, and never redact (where redaction
happens: :mod:`kvdiag.redact`); every file is written atomically.
"""

from __future__ import annotations

import html as _html
import os
from collections.abc import Callable
from pathlib import Path

from kvdiag.bundle.io import atomic_write_text
from kvdiag.model.bundle import Bundle
from kvdiag.model.report import Report
from kvdiag.model.run import Finding
from kvdiag.model.verdict import Diagnosis
from kvdiag.redact.bundle import redact_bundle
from kvdiag.redact.rules import redact_obj
from kvdiag.report.html import render_html
from kvdiag.report.json import render_json, report_of
from kvdiag.report.markdown import render_markdown
from kvdiag.report.view import ReportView, build_view

__all__ = ["run_view", "write_view"]

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


def run_view(bundle: Bundle, diagnosis: Diagnosis, *, out_dir: Path, bundle_dir: Path | None = None,
             command: str = "", bundle_path: str | None = None) -> ReportView:
    """The one view of a run's report: built once from ``bundle`` and the diagnosis stored with it, for
    report files written in ``out_dir`` (``bundle_path``: where the page finds the bundle folder;
    default ``bundle_dir`` relative to ``out_dir`` when it exists)."""
    # (kvdiag.redact says why the report's inputs are redacted here)
    bundle = redact_bundle(bundle)
    diagnosis, command = redact_obj((diagnosis, command))
    if bundle_path is None and bundle_dir is not None and bundle_dir.is_dir():
        bundle_path = _relative(bundle_dir, out_dir)
    return build_view(report_of(bundle, diagnosis, command=command, bundle_path=bundle_path), bundle,
                      bundle_dir if bundle_dir is not None and bundle_dir.is_dir() else None)


def _fallback_markdown(report: Report, error: str) -> str:
    return f"### kvdiag: `{report.verdict.kind.value}`\n\n{report.verdict.summary}\n"


# The report files and their renderers, each ``(view) -> str``; a page that fails to render gets its fallback.
RENDERERS: dict[str, Callable[[ReportView], str]] = {
    "report.html": render_html, "report.md": render_markdown, "report.json": render_json}
_FALLBACKS: dict[str, Callable[[Report, str], str]] = {"report.html": _fallback_html,
                                                       "report.md": _fallback_markdown}


def write_view(out_dir: Path, view: ReportView) -> dict[str, Path]:
    """Write out_dir/report.json, report.html and report.md from ``view`` (each atomically).

    Works on a partial bundle (an interrupted run). A renderer that fails gets a minimal fallback page
    and a ``report_render_failed`` finding in report.json, so a run never ends without a readable
    report.
    """
    report = view.report
    texts: dict[str, str] = {}
    failures: list[Finding] = []
    for name, fallback in _FALLBACKS.items():
        try:
            texts[name] = RENDERERS[name](view)
        except Exception as exc:  # a rendering bug must not cost the user the report
            failures.append(Finding(kind="report_render_failed", message=f"{name}: {type(exc).__name__}: {exc}"))
            texts[name] = fallback(report, f"{type(exc).__name__}: {exc}")
    report.findings.extend(failures)
    # report.json last to render (it carries the failures) and first to be written: it is the contract.
    texts = {"report.json": RENDERERS["report.json"](view), **texts}
    paths = {name: out_dir / name for name in REPORT_FILES}
    for name, text in texts.items():
        atomic_write_text(paths[name], text)
    return paths
