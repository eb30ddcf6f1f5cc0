"""The bundle is the truth: `kvdiag report` and `kvdiag analyze` on any output folder say what the run said.

Each command really runs (repro stock and fixed, soak with and without a stall on the simulated
engine, ab, capture of a real hanging program); then `kvdiag analyze DIR --json` recomputes the
diagnosis from the bundle alone and `kvdiag report DIR` re-renders the stored one. Verdict, exit
code and the per-engine verdicts must equal the run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvcli import read_report, run_kvdiag

HANGERS = Path(__file__).resolve().parents[1] / "fixtures" / "hangers"
sys.path.insert(0, str(HANGERS))
import hanger_kit as hk  # noqa: E402

pytestmark = pytest.mark.timeout(400)


def _kinds(by_engine: dict[str, Any]) -> dict[str, str]:
    return {name: v["kind"] for name, v in by_engine.items()}


def _said(out: Path) -> tuple[str, int, dict[str, str], object]:
    """(verdict kind, exit code, per-engine kinds, ab) as report.json has them."""
    report = read_report(out)
    verdict = report["verdict"]
    assert isinstance(verdict, dict)
    by = report["verdicts_by_engine"]
    assert isinstance(by, dict)
    code = report["exit_code"]
    assert isinstance(code, int)
    return str(verdict["kind"]), code, _kinds(by), report.get("ab")


def assert_bundle_is_the_truth(out: Path, run: subprocess.CompletedProcess[str]) -> tuple[str, int]:
    """The run's own answer, then analyze and report on its folder: all three agree."""
    kind, code, by_engine, ab = _said(out)
    assert code == run.returncode, (code, run.returncode, run.stderr[-2000:])
    stored = json.loads((out / "bundle" / "bundle.json").read_text())["diagnosis"]
    assert stored["verdict"]["kind"] == kind and stored["exit_code"] == code
    assert _kinds(stored["verdicts_by_engine"]) == by_engine

    again = run_kvdiag("analyze", str(out), "--json", timeout=120)
    data = json.loads(again.stdout)
    assert again.returncode == code, again.stderr[-2000:]
    assert data["verdict"]["kind"] == kind and data["exit_code"] == code
    assert _kinds(data["verdicts_by_engine"]) == by_engine
    assert data["agrees_with_run"] is True

    rendered = run_kvdiag("report", str(out), timeout=120)
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    assert _said(out) == (kind, code, by_engine, ab)
    return kind, code


def test_repro_stock_and_fixed(tmp_path: Path) -> None:
    stock = tmp_path / "stock"
    run = run_kvdiag("repro", "two-engine", "--out", str(stock))
    assert assert_bundle_is_the_truth(stock, run) == ("gil_cycle", 10)
    fixed = tmp_path / "fixed"
    run = run_kvdiag("repro", "two-engine", "--allocator", "fixed", "--out", str(fixed))
    assert assert_bundle_is_the_truth(fixed, run) == ("healthy", 0)


def test_ab_nests_two_runs_the_loader_understands(tmp_path: Path) -> None:
    out = tmp_path / "ab"
    run = run_kvdiag("ab", "--out", str(out), timeout=400)
    kind, code = assert_bundle_is_the_truth(out, run)
    assert (kind, code) == ("gil_cycle", 0)
    report = read_report(out)
    ab = report["ab"]
    assert isinstance(ab, dict) and ab["separated"] is True
    assert ab["stock"]["verdict"] == "gil_cycle" and ab["fixed"]["verdict"] == "healthy"
    by_engine = _kinds(report["verdicts_by_engine"])  # type: ignore[arg-type]
    assert by_engine["stock"] == "gil_cycle" and by_engine["fixed"] == "healthy"
    assert by_engine["stock/vlm"] == "gil_cycle" and by_engine["fixed/vlm"] == "healthy"
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    assert bundle["runs"] == {"stock": "../stock/bundle", "fixed": "../fixed/bundle"}
    # each side is a run folder of its own, and says the same as its line in the comparison
    for side, want in (("stock", ("gil_cycle", 10)), ("fixed", ("healthy", 0))):
        kind_code = _said(out / side)[:2]
        assert kind_code == want
        again = run_kvdiag("analyze", str(out / side), "--json", timeout=120)
        assert again.returncode == want[1] and json.loads(again.stdout)["verdict"]["kind"] == want[0]


def test_soak_stall_and_no_stall(tmp_path: Path) -> None:
    stall = tmp_path / "stall"
    run = run_kvdiag("soak", "--model", "sim", "--duration", "60", "--out", str(stall), timeout=300)
    kind, code = assert_bundle_is_the_truth(stall, run)
    assert code == 10, (kind, run.stderr[-2000:])
    calm = tmp_path / "calm"
    run = run_kvdiag("soak", "--model", "sim", "--allocator", "fixed", "--duration", "6", "--out", str(calm),
                     timeout=300)
    assert assert_bundle_is_the_truth(calm, run) == ("healthy", 0)


def test_capture(tmp_path: Path) -> None:
    out = tmp_path / "capture"
    with hk.running("lock_inversion", bound_s=120) as h:
        run = run_kvdiag("capture", "--pid", str(h.pid), "--timeout", "60", "--out", str(out), timeout=180)
    kind, code = assert_bundle_is_the_truth(out, run)
    assert (kind, code) == ("lock_order_inversion", 10), run.stdout[-2000:]
