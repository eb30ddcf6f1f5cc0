"""What a first-time user runs into: the CLI in a child process, as typed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvcli import ROOT, read_report, run_kvdiag

from kvdiag.model.evidence import ToolRun
from kvdiag.scenario.loader import load_scenario

pytestmark = pytest.mark.timeout(120)

COMMAND_AND_EXTERNAL = f"""
name: unswitchable
engines:
  - name: plain
    kind: command
    command: ["{sys.executable}", "-c", "import time; time.sleep(60)"]
  - name: theirs
    kind: vllm
    allocator: external
  - name: sim1
"""


@pytest.mark.parametrize("argv", [["ab"], ["repro", "two-engine", "--allocator", "fixed"]])
def test_allocator_switch_on_engines_kvdiag_cannot_switch_is_refused_up_front(tmp_path: Path,
                                                                              argv: list[str]) -> None:
    scen = tmp_path / "s.yaml"
    scen.write_text(COMMAND_AND_EXTERNAL)
    out = tmp_path / "out"
    run = run_kvdiag(*argv, "--scenario", str(scen), "--out", str(out), timeout=60)
    assert run.returncode == 2, run.stderr
    assert "plain (kind: command)" in run.stderr and "theirs (allocator: external)" in run.stderr
    assert "sim1" not in run.stderr.split("hint")[0].split("do not use")[1]
    assert not out.exists()                         # nothing launched, no folder made
    assert "Traceback" not in run.stderr


def test_scenario_names_work_from_any_folder(tmp_path: Path) -> None:
    # the embedded name doctor always took, and the README's `scenarios/NAME.yaml`, from a folder
    # that has no scenarios/ of its own
    for name in ("two-engine", "scenarios/two-engine-prealloc-off.yaml", "soak-hybrid"):
        scen, source, _ = load_scenario(Path(name))
        assert scen.engines and "not found" not in source
        run = subprocess.run([sys.executable, "-m", "kvdiag", "doctor", "--scenario", name, "--json"],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode in (0, 10), (name, run.stderr)
    missing = run_kvdiag("repro", "two-engine", "--scenario", "no-such-thing", "--out", str(tmp_path / "o"),
                         timeout=60)
    assert missing.returncode == 2 and "two-engine-vllm-cpu" in missing.stderr    # the hint names them


def test_a_renamed_bundle_file_is_analyzed_and_named(tmp_path: Path) -> None:
    renamed = tmp_path / "some-name.json"
    shutil.copy(ROOT / "tests" / "fixtures" / "bundles" / "gil_cycle" / "bundle.json", renamed)
    run = run_kvdiag("analyze", str(renamed), timeout=60)
    assert run.returncode == 10, run.stderr
    assert "verdict: gil_cycle" in run.stdout and f"bundle: {renamed}" in run.stdout
    assert "bundle.json" not in run.stdout + run.stderr


@pytest.fixture(scope="module")
def repro_80(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("repro") / "out"
    run = subprocess.run([sys.executable, "-m", "kvdiag", "repro", "two-engine", "--out", str(out)],
                         capture_output=True, text=True, timeout=100, cwd=ROOT, env={**os.environ, "COLUMNS": "80"})
    assert run.returncode == 10, run.stderr[-3000:]
    return run, out


def test_outcome_on_stdout_progress_on_stderr(repro_80: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    run, out = repro_80
    assert "verdict: gil_cycle" in run.stdout and f"report.html: {out / 'report.html'}" in run.stdout
    assert run.stdout.rstrip().endswith("exit code 10")
    assert "phase banner" in run.stderr and "stall detected" in run.stderr
    assert "verdict: " not in run.stderr and "report.html" not in run.stderr


def test_identifiers_stay_whole_at_80_columns(repro_80: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    run, _ = repro_80
    table = run.stdout.split("\nengines\n", 1)[1].split("\n  ", 1)[0].splitlines()
    assert table[0].split() == ["engine", "allocator", "phase", "healthy", "verdict", "EngineCore", "banner"]
    assert any(row.split()[:3] == ["vlm", "stock", "stalled"] and "no (gil cycle)" in row and "gil_cycle" in row
               for row in table), table
    assert all(len(row) <= 80 for row in table)
    doctor = subprocess.run([sys.executable, "-m", "kvdiag", "doctor", "--scenario", "two-engine"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, "COLUMNS": "80"})
    assert "KVCACHED_PAGE_PREALLOC_ENABLED=false" in doctor.stdout
    assert all(len(line) <= 80 for line in doctor.stdout.splitlines())


def test_reports_say_the_engines_were_simulated(repro_80: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    run, out = repro_80
    assert "simulated engines: coder, vlm" in run.stdout
    assert read_report(out)["simulated_engines"] == ["coder", "vlm"]
    md = (out / "report.md").read_text()
    assert "**Simulated engines:** `coder`, `vlm`" in md.split("#### ", 1)[0]     # above the first section
    page = (out / "report.html").read_text()
    assert page.index('id="simulated"') < page.index('id="verdict"')


def test_gdb_left_out_on_purpose_is_skipped_not_failed(repro_80: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, out = repro_80
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    gdb = [t for p in bundle["processes"] for t in p["tools"] if t["tool"] == "gdb"]
    assert gdb and all(t["skipped"] and not t["ok"] and "pystack read the native frames" in t["error"] for t in gdb)
    page = (out / "report.html").read_text()
    rows = re.findall(r"<tr><td>gdb</td><td><span class=\"badge (\w+)\">(\w+)</span>", page)
    assert rows and all(r == ("info", "skipped") for r in rows), rows
    # an older bundle (no field) still loads, its gdb failed as it said
    old = {k: v for k, v in gdb[0].items() if k != "skipped"}
    assert ToolRun.model_validate(old).state == "failed"


def test_banner_check_agrees_with_the_soak_hybrid_engine_that_hung(tmp_path: Path) -> None:
    # A real soak-hybrid run: 496 pages per layer (no start-up hang), stalled in the GIL cycle under load.
    bundle = ROOT / "tests" / "fixtures" / "bundles" / "soak_gil_cycle" / "bundle.json"
    analyzed = run_kvdiag("analyze", str(bundle), timeout=60)
    assert analyzed.returncode == 10 and "mechanism: gil_cycle" in analyzed.stdout, analyzed.stdout
    [engine] = json.loads(bundle.read_text())["engines"]
    log = tmp_path / "hybrid.log"
    log.write_text("\n".join(b["raw"] for b in engine["banners"]) + "\n")
    checked = run_kvdiag("banner", str(log), timeout=60)
    assert checked.returncode == 10, checked.stdout
    assert "RISK under load" in checked.stdout and "no deadlock risk" not in checked.stdout
    off = tmp_path / "off.log"
    off.write_text(log.read_text().replace("enable_prealloc=1", "enable_prealloc=0"))
    assert run_kvdiag("banner", str(off), timeout=60).returncode == 0


def test_help_names_every_exit_code_and_the_tools() -> None:
    capture = run_kvdiag("capture", "--help", timeout=60).stdout
    flat = " ".join(capture.replace("│", " ").split())
    for text in ("6 inconclusive", "130 interrupted", "proc, py-spy, pystack, gdb", "py-spy-nonblocking"):
        assert text in flat, text
    started = run_kvdiag("capture", "--pid", "999999999", timeout=60)
    assert "at most" not in started.stderr
    for command in (["repro", "two-engine"], ["soak"], ["analyze"]):
        flat = " ".join(run_kvdiag(*command, "--help", timeout=60).stdout.replace("│", " ").split())
        assert "6 inconclusive" in flat or "6 nothing stalled" in flat, command
    for text in ("the seed's", "reproduction A", "prefix_build"):
        assert text not in run_kvdiag("doctor", "--scenario", "two-engine", timeout=60).stdout
