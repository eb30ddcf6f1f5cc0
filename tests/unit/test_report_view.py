"""The report of a run is built once, from the bundle and its stored diagnosis, and every output reads it."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

import kvdiag.report.json as report_json
from kvdiag.bundle.io import load_bundle
from kvdiag.cli.common import print_outcome
from kvdiag.cli.main import main
from kvdiag.model.report import Report
from kvdiag.runs.output import finish

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


def test_a_run_builds_its_report_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Report] = []

    class Counted(Report):
        def __init__(self, **kw: object) -> None:
            super().__init__(**kw)
            built.append(self)

    monkeypatch.setattr(report_json, "Report", Counted)
    bundle = load_bundle(BUNDLES / "gil_cycle")[0]
    bundle.diagnosis = None
    arts = finish(tmp_path, bundle)
    out = io.StringIO()
    print_outcome(arts, con=Console(file=out, width=200, color_system=None))
    assert len(built) == 1
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["verdict"]["kind"] == "gil_cycle" and "verdict: gil_cycle" in out.getvalue()
    assert all(len(i["refs"]) == len(i["frames"]) for i in data["verdict"]["evidence"])


def test_report_of_a_bundle_without_stored_engine_judgements_says_what_the_run_said(tmp_path: Path) -> None:
    """A bundle written before the diagnosis stored health lines and banner risks: `kvdiag report` judges
    them once (analyze), and the report equals the one written from a diagnosis that stored them."""
    run = tmp_path / "run"
    shutil.copytree(BUNDLES / "vllm_two_engine_stock", run / "bundle")
    bundle = load_bundle(run / "bundle")[0]
    bundle.diagnosis = None
    finish(run, bundle)
    written = json.loads((run / "report.json").read_text())
    stored = json.loads((run / "bundle" / "bundle.json").read_text())
    assert stored["diagnosis"]["engines"]
    stored["diagnosis"].pop("engines")
    (run / "bundle" / "bundle.json").write_text(json.dumps(stored))
    assert main(["report", str(run), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    written.pop("bundle_path"), again.pop("bundle_path")
    assert again == written
    assert [e["health"] for e in again["engines"]] and all(e["health"] for e in again["engines"])
