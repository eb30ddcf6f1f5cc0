"""What a first-time user runs into: the CLI in a child process, as typed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.scenario import load_scenario
from tests.integration.kvcli import ROOT, run_kvdiag

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
