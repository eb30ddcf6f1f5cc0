"""`kvdiag analyze BUNDLE` on saved bundles: verdict text, --json, exit codes."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from kvdiag.cli.main import main

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_analyze_gil_cycle_bundle_exits_10() -> None:
    code, out = run("analyze", str(BUNDLES / "gil_cycle"))
    assert code == 10
    assert out.startswith("verdict: gil_cycle  (high confidence)")
    assert "alloc_page" in out and "map_pages" in out and "wait-for cycle:" in out


def test_analyze_json_accepts_bundle_json_path() -> None:
    code, out = run("analyze", str(BUNDLES / "lock_inversion" / "bundle.json"), "--json")
    data = json.loads(out)
    assert code == data["exit_code"] == 10
    assert data["verdict"]["kind"] == "lock_order_inversion"
    assert list(data["verdicts_by_engine"]) and data["verdict"]["evidence"]


def test_analyze_healthy_bundle_exits_0() -> None:
    code, out = run("analyze", str(BUNDLES / "vllm_idle"))
    assert code == 0 and out.startswith("verdict: healthy")


def test_analyze_missing_bundle_is_a_usage_error(tmp_path: Path) -> None:
    code, out = run("analyze", str(tmp_path / "nothing-here"))
    assert code == 2 and "no such file or folder" in out and "Traceback" not in out
