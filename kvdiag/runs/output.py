"""The output folder of a run and the one tail every command ends with: redact, analyze, write the
bundle, render. Apart from the launcher, so a command that starts no engine (capture, merge) loads
only what it uses."""

from __future__ import annotations

import datetime as _dt
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvdiag.analyze.diagnosis import complete, diagnose
from kvdiag.analyze.soak import judged_soak, stall_to_verdict_s
from kvdiag.bundle.io import write_bundle
from kvdiag.errors import UsageError
from kvdiag.model.bundle import Bundle
from kvdiag.model.run import TimelineEvent
from kvdiag.model.verdict import Diagnosis, Verdict
from kvdiag.redact.bundle import redact_bundle
from kvdiag.report import run_view, write_view
from kvdiag.report.view import ReportView


def default_out_dir(command: str) -> Path:
    """reports/<command>-<timestamp>-<random>/ under the current directory (never reused)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("reports") / f"{command.replace(' ', '-')}-{stamp}-{secrets.token_hex(2)}"


def prepare_out_dir(out: Path | None, command: str) -> Path:
    """The output folder (``out``, else a new one under reports/), created and checked writable."""
    path = out if out is not None else default_out_dir(command)
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / "bundle").mkdir(exist_ok=True)
        # A fresh file of our own (never a same-named file someone keeps there), gone on close.
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvdiag-write-test-"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write output folder {path}: {exc.strerror or exc}",
                         hint="pass --out DIR pointing at a writable folder") from None
    return path


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


__all__ = ["RunArtifacts", "default_out_dir", "finish", "prepare_out_dir"]
