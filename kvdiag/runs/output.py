"""The output folder of a run and the one tail every command ends with: redact, analyze, write the
bundle, render. Apart from the launcher, so a command that starts no engine (capture, merge) loads
only what it uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvdiag.analyze.diagnosis import complete, diagnose
from kvdiag.analyze.soak import judged_soak, stall_to_verdict_s
from kvdiag.bundle.io import write_bundle
from kvdiag.model.bundle import Bundle
from kvdiag.model.run import TimelineEvent
from kvdiag.model.verdict import Diagnosis, Verdict
from kvdiag.redact.bundle import redact_bundle
from kvdiag.report import run_view, write_view
from kvdiag.report.view import ReportView


@dataclass
class RunArtifacts:
    out_dir: Path
    bundle: Bundle
    verdict: Verdict
    verdicts_by_engine: dict[str, Verdict]
    exit_code: int
    paths: dict[str, Path]
    view: ReportView | None = None   # the report as written, for the summary printed after it


def finish(out_dir: Path, bundle: Bundle, *, runs: dict[str, Bundle] | None = None,
           verdict_t: float | None = None, diagnosis: Diagnosis | None = None) -> RunArtifacts:
    """The one tail of every run: redact → analyze → store the diagnosis → write bundle → render.

    ``runs``: the nested runs' bundles (``kvdiag ab``); ``verdict_t``: run time of the verdict
    event added to the timeline; ``diagnosis``: already computed from this bundle's evidence (a
    capture that said its verdict before the environment record was in: the rules read no
    environment). Renderers read only the diagnosis stored in the bundle.
    """
    red = redact_bundle(bundle)   # kvdiag.redact says why here
    if red.soak is not None:   # the soak's judgement, stored beside the readings it came from
        red.soak = judged_soak(red.soak, red.metrics)
    diag = diagnosis if diagnosis is not None else diagnose(red, runs)
    if verdict_t is not None:
        red.stall_to_verdict_s = stall_to_verdict_s(red.timeline, verdict_t)
        red.timeline.append(TimelineEvent(t=round(verdict_t, 3), event="verdict", detail=diag.verdict.kind.value))
    red.diagnosis = diag = complete(red.model_copy(update={"diagnosis": diag}))
    red = write_bundle(red, out_dir / "bundle")
    view = run_view(red, diag, out_dir=out_dir, bundle_dir=out_dir / "bundle")
    paths = write_view(out_dir, view)
    return RunArtifacts(out_dir, red, diag.verdict, diag.verdicts_by_engine, diag.exit_code, paths, view)


__all__ = ["RunArtifacts", "finish"]
