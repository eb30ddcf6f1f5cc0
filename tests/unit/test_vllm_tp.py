"""Tensor-parallel vLLM pieces that need no vLLM: the plugin's rank selection, the run's vllm_dist_*
segments at teardown, the scenario's serving phase."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvdiag.launch.owned import sweep_shm, vllm_dist_idents
from kvdiag.osread.holders import file_id
from kvdiag.scenario.loader import load_scenario

ROOT = Path(__file__).resolve().parents[2]


def test_the_runs_vllm_dist_segments_go_whatever_their_age_and_no_one_elses(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    run = tmp_path / "kvdiag-run-x"
    (run / "tmp").mkdir(parents=True)
    (run / "tmp" / "vllm_dist_aa11").write_text("rendezvous")
    ours = [shm / "vllm_dist_aa11-tp:0-[0-1]-cpushm_0", shm / "vllm_dist_aa11-tp:0-[0-1]-cpushm_1"]
    theirs = shm / "vllm_dist_bb22-tp:0-[0-1]-cpushm_0"
    for p in (*ours, theirs):
        p.write_bytes(b"x")
    time.sleep(1.2)   # older than the run's start: only the rendezvous name makes them ours
    idents = vllm_dist_idents([run])
    assert idents == ["vllm_dist_aa11"]
    seen = {f for p in (*ours, theirs) if (f := file_id(str(p)))}   # even a file seen held: not named by the run
    swept = sweep_shm(time.time(), seen, shm_dir=str(shm), idents=idents)
    assert sorted(swept.removed) == sorted(p.name for p in ours)
    assert theirs.exists() and not any(p.exists() for p in ours)


def test_plugin_arms_only_the_worker_of_the_hang_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    import kvdiag.vllm_plugin as plugin

    monkeypatch.setenv(plugin.ENABLE_ENV, "fixed")
    monkeypatch.setenv(plugin.HANG_RANK_ENV, "1")
    monkeypatch.setenv(plugin.STALL_ENV, "2")
    monkeypatch.setattr(multiprocessing, "current_process", lambda: SimpleNamespace(name="VllmWorker-0"))
    assert plugin._worker_rank() == 0 and plugin._hang_rank() == 1
    plugin.register()   # rank 0: nothing to arm, and never the EngineCore's block pool
    assert not plugin._installed
    monkeypatch.setattr(multiprocessing, "current_process", lambda: SimpleNamespace(name="MainProcess"))
    assert plugin._worker_rank() is None


def test_tp2_scenario_serves_after_startup() -> None:
    scen, _, _ = load_scenario(ROOT / "scenarios" / "tp2-vllm-cpu.yaml")
    assert scen.serve is not None and scen.serve.duration_s > 0
    engine = scen.engines[0]
    assert "--tensor-parallel-size" in engine.vllm.args
    assert engine.env["KVDIAG_VLLM_HANG_RANK"] == "1" and engine.allocator != "external"


def test_a_tensor_parallel_worker_is_named_by_its_rank() -> None:
    from kvdiag.analyze.vllm_titles import process_title, worker_rank
    from kvdiag.model.evidence import ProcessEvidence

    tp1 = ProcessEvidence(pid=2, comm="VLLM::Worker_TP", cmdline=["VLLM::Worker_TP1\0\0"])
    assert process_title(tp1) == "Worker_TP1" and worker_rank(tp1) == 1
    assert process_title(ProcessEvidence(pid=3, comm="python3", cmdline=["python3", "x.py"])) is None


def test_the_reaper_of_a_killed_kvdiag_removes_its_engines_vllm_dist_segments() -> None:
    """kvdiag SIGKILLed: its reaper (stdin at EOF, kvdiag gone) removes the run folder and, named from the
    rendezvous file in it, the engines' all-reduce segments in /dev/shm."""
    ident = f"vllm_dist_{uuid.uuid4().hex}"
    run = Path("/tmp") / f"kvdiag-run-{uuid.uuid4().hex[:12]}"
    (run / "tmp").mkdir(parents=True)
    (run / "tmp" / ident).write_text("rendezvous")
    seg = Path("/dev/shm") / f"{ident}-tp:0-[0-1]-cpushm_0"
    seg.write_bytes(b"x")
    seg_id = file_id(str(seg))
    assert seg_id is not None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()   # a pid that no longer runs stands for the SIGKILLed kvdiag
    try:
        reaper = subprocess.run([sys.executable, "-m", "kvdiag.launch.reaper", uuid.uuid4().hex[:12], "0.5",
                                 str(gone.pid)], text=True, timeout=60, cwd=ROOT,
                                input=f"dir {run}\nshm {time.time():.3f}\nown {seg_id[0]} {seg_id[1]}\n")
        assert reaper.returncode == 0
        assert not run.exists() and not seg.exists()
    finally:
        seg.unlink(missing_ok=True)
        if run.exists():
            shutil.rmtree(run)
