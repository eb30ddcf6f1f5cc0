"""`kvdiag capture` of an engine tree says its verdict as soon as the evidence is in, takes the
EngineCore first, and pauses the rest of the tree only when the EngineCore's evidence does not decide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvcli import ROOT

from kvdiag.capture.bundle import capture_tree
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence

HANGERS = Path(__file__).resolve().parents[1] / "fixtures" / "hangers"
sys.path.insert(0, str(HANGERS))
import hanger_kit as hk  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_the_verdict_comes_before_the_environment_and_the_reports(tmp_path: Path) -> None:
    with hk.running("gil_cycle", under_parent=True, title="VLLM::EngineCore", bound_s=120,
                    build_dir=tmp_path / "build") as h:
        seen: list[Bundle] = []
        bundle = capture_tree(h.root_pid, tmp_path / "b", timeout_s=10.0, save=False,
                              on_evidence=lambda b: seen.append(b.model_copy(deep=True)))
        [early] = seen
        assert early.processes and early.environment is None      # said before the environment was in
        assert bundle.environment is not None and not (tmp_path / "b" / "bundle.json").exists()

        out = tmp_path / "cli"
        run = subprocess.run([sys.executable, "-m", "kvdiag", "capture", "--pid", str(h.root_pid), "--out", str(out)],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 10, run.stderr[-2000:]
    assert run.stdout.splitlines()[0].startswith("verdict: gil_cycle")
    data = json.loads((out / "bundle" / "bundle.json").read_text())
    procs = {p["role"]: p for p in data["processes"]}
    core, parent = procs["engine_core"], next(p for p in data["processes"] if p["role"] != "engine_core")
    tools = {t["tool"]: t for t in core["tools"]}
    assert tools["pystack"]["ok"]                                 # every tool on the EngineCore
    rest = {t["tool"]: t for t in parent["tools"]}
    assert rest["proc"]["ok"] and rest["py-spy"]["ok"]           # the rest read without pausing it
    assert rest["pystack"]["skipped"] and "EngineCore's evidence decided (gil_cycle)" in rest["pystack"]["error"]
    assert ProcessEvidence.model_validate(parent).threads          # its Python stacks are still there


def test_an_undecided_engine_core_gets_the_rest_paused_once_with_one_proc_window(tmp_path: Path) -> None:
    # An idle EngineCore decides nothing: the rest of the tree gets its pausing tools too, added to the
    # /proc evidence its first-stage window took (not a second window).
    with hk.running("healthy_idle", under_parent=True, title="VLLM::EngineCore", bound_s=120,
                    build_dir=tmp_path / "build") as h:
        bundle = capture_tree(h.root_pid, tmp_path / "b", timeout_s=10.0, save=False,
                              decides=lambda evs, fs: None)
    parent = next(p for p in bundle.processes if p.pid == h.root_pid)
    tools = {t.tool: t for t in parent.tools}
    assert tools["proc"].ok and tools["py-spy"].ok and tools["pystack"].ok, parent.tools
    assert [t.tool for t in parent.tools].count("proc") == 1 and parent.progress is not None
    assert tools["pystack"].started_s is not None and tools["proc"].started_s is not None
    assert tools["pystack"].started_s >= tools["proc"].started_s + tools["proc"].duration_s - 0.05
    main = [t for t in parent.threads if t.tid == h.root_pid]
    assert main and "pystack" in main[0].frames_by_tool and main[0].state.value != "unknown"
