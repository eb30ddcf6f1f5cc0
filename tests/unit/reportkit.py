"""Reports of hand-built bundles: the verdicts a test holds, judged into a diagnosis as a run stores it
(kvdiag.analyze.engines.diagnosis_of), then rendered through the one view (kvdiag.report)."""

from __future__ import annotations

from pathlib import Path

from kvdiag.analyze.engines import diagnosis_of
from kvdiag.model.bundle import Bundle
from kvdiag.model.report import Report
from kvdiag.model.verdict import ABComparison, Verdict
from kvdiag.report import run_view, write_view
from kvdiag.report.json import report_of
from kvdiag.report.view import ReportView, build_view


def build_report(bundle: Bundle, verdict: Verdict, *, command: str, exit_code: int,
                 verdicts_by_engine: dict[str, Verdict] | None = None,
                 ab: ABComparison | None = None, bundle_path: str | None = None) -> Report:
    """The report of ``bundle`` judged as ``verdict``."""
    diag = diagnosis_of(bundle, verdict, exit_code=exit_code, verdicts_by_engine=verdicts_by_engine, ab=ab)
    return report_of(bundle, diag, command=command, bundle_path=bundle_path)


def write_outputs(out_dir: Path, bundle: Bundle, verdict: Verdict, *, command: str, exit_code: int,
                  verdicts_by_engine: dict[str, Verdict] | None = None,
                  ab: ABComparison | None = None, bundle_dir: Path | None = None) -> dict[str, Path]:
    """report.json, report.html and report.md of ``bundle`` judged as ``verdict``, in ``out_dir``."""
    bundle_dir = bundle_dir if bundle_dir is not None else out_dir / "bundle"
    diag = diagnosis_of(bundle, verdict, exit_code=exit_code, verdicts_by_engine=verdicts_by_engine, ab=ab)
    return write_view(out_dir, run_view(bundle, diag, out_dir=out_dir, bundle_dir=bundle_dir, command=command))


def view_of(report: Report, bundle: Bundle | None = None, bundle_dir: Path | None = None) -> ReportView:
    """The view every renderer reads, of a report built here."""
    return build_view(report, bundle, bundle_dir)
