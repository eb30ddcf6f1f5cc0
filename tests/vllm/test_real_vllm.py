"""Real vLLM CPU 0.32 end to end: kvdiag launches `vllm serve` with its
kvcached-shaped plugin, reproduces the seed's hang inside a real EngineCore, soaks a real server, and leaves
no process, temp file or shared-memory segment behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import Leftovers, VllmSetup, assert_clean
from kvcli import read_report, run_kvdiag

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "scenarios" / "two-engine-vllm-cpu.yaml"


def test_two_engine_stock_hangs_in_engine_two_core(vllm_setup: VllmSetup, leftovers: Leftovers,
                                                   tmp_path: Path) -> None:
    before = leftovers.snapshot()
    out = tmp_path / "stock"
    proc = run_kvdiag("repro", "two-engine", "--scenario", str(SCENARIO), "--out", str(out), timeout=900)
    assert proc.returncode == 10, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = read_report(out)
    verdict = report["verdict"]
    assert isinstance(verdict, dict)
    assert verdict["kind"] == "gil_cycle" and verdict["engine"] == "vlm", verdict["summary"]
    frames = " ".join(" ".join(e["frames"]) for e in verdict["evidence"])
    assert "alloc_page" in frames and "take_null_block" in frames and ("take_gil" in frames or "map_pages" in frames)
    engines = {e["name"]: e for e in report["engines"]}  # type: ignore[union-attr]
    assert engines["coder"]["healthy"] is True and engines["vlm"]["healthy"] is False
    # The hang is in engine 2's EngineCore (a VLLM::EngineCore process, not the API server or the Worker).
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    core_pid = engines["vlm"]["pids"]["engine_core"]
    assert f"pid {core_pid} (the EngineCore of engine vlm)" in verdict["summary"], verdict["summary"]
    core = [p for p in bundle["processes"] if p["pid"] == core_pid]
    assert core and core[0]["role"] == "engine_core" and core[0]["comm"].startswith("VLLM::EngineCor")
    roles = {p["role"] for p in bundle["processes"] if p["engine"] == "vlm"}
    assert {"api_server", "engine_core", "worker"} <= roles
    log = (out / "bundle" / "logs" / "vlm.log").read_text()
    assert "Init C++ PageAllocator" in log and "(EngineCore pid=" in log and "kvdiag plugin" in log
    timeline = [e["event"] for e in report["timeline"]]  # type: ignore[union-attr]
    assert "completion answered" in timeline  # engine 1 served while engine 2 hung
    assert_clean(leftovers, before)


def test_two_engine_fixed_starts_and_both_answer(vllm_setup: VllmSetup, leftovers: Leftovers,
                                                 tmp_path: Path) -> None:
    before = leftovers.snapshot()
    out = tmp_path / "fixed"
    proc = run_kvdiag("repro", "two-engine", "--scenario", str(SCENARIO), "--allocator", "fixed",
                      "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = read_report(out)
    engines = {e["name"]: e for e in report["engines"]}  # type: ignore[union-attr]
    assert engines["coder"]["healthy"] is True and engines["vlm"]["healthy"] is True
    assert engines["vlm"]["allocator"] == "fixed" and engines["vlm"]["banner"]["mem_size_per_layer_mb"] == 11
    answered = [e["engine"] for e in report["timeline"] if e["event"] == "completion answered"]  # type: ignore
    assert sorted(answered) == ["coder", "vlm"]
    assert_clean(leftovers, before)


def test_soak_launches_real_vllm_and_completes(vllm_setup: VllmSetup, leftovers: Leftovers,
                                               tmp_path: Path) -> None:
    before = leftovers.snapshot()
    out = tmp_path / "soak"
    # The default 32 streams x 256 tokens fill the 2,048-token KV cache of the embedded soak-vllm scenario.
    proc = run_kvdiag("soak", "--model", vllm_setup.model, "--duration", "10", "--out", str(out), timeout=600)
    report = read_report(out)
    kind = report["verdict"]["kind"]  # type: ignore[index]
    # 0 healthy (or slow_start: a busy machine slowed the start, progress never stopped); 6 when it kept the
    # server from ever filling its KV cache (said, not a stall). Never a stall.
    assert (proc.returncode, kind) in ((0, "healthy"), (0, "slow_start"), (6, "not_saturated")), proc.stdout[-4000:]
    soak = report["soak"]
    assert isinstance(soak, dict)
    assert soak["requests_ok"] > 0 and soak["tokens"] >= soak["requests_ok"] * 256 and not soak["stalled"]
    assert_clean(leftovers, before)


def test_soak_names_a_stall_injected_into_the_engine_core(vllm_setup: VllmSetup, leftovers: Leftovers,
                                                          tmp_path: Path) -> None:
    text = (ROOT / "scenarios" / "soak-vllm-cpu.yaml").read_text()
    scen = tmp_path / "stall.yaml"
    scen.write_text(text.replace("      KVCACHED_IPC_NAME: SOAK", "      KVCACHED_IPC_NAME: SOAK\n"
                                 "      KVDIAG_VLLM_STALL_AFTER_S: \"4\""))
    before = leftovers.snapshot()
    out = tmp_path / "stall"
    proc = run_kvdiag("soak", "--scenario", str(scen), "--duration", "60", "--concurrency", "8",
                      "--max-tokens", "48", "--out", str(out), timeout=600)
    assert proc.returncode == 10, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = read_report(out)
    verdict = report["verdict"]
    assert isinstance(verdict, dict)
    assert verdict["kind"] == "gil_cycle", verdict["summary"]
    frames = " ".join(" ".join(e["frames"]) for e in verdict["evidence"])
    assert "alloc_page" in frames
    events = [e["event"] for e in report["timeline"]]  # type: ignore[union-attr]
    assert "stall detected" in events
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    core = [p for p in bundle["processes"] if p["role"] == "engine_core"]
    assert core and str(core[0]["pid"]) in verdict["summary"]
    assert_clean(leftovers, before)


def test_soak_and_vllm_bench_count_the_same_tokens(vllm_setup: VllmSetup, tmp_path: Path) -> None:
    """Same server, same request mix: bench and kvdiag's client both finish every request, kvdiag's SSE
    reader fails on nothing, and both take the token count from usage (speed figures: the benchmark)."""
    proc = subprocess.run([sys.executable, "benchmarks/soak_accuracy.py", "--vllm", "--rounds", "1",
                           "--num-prompts", "40", "--concurrency", "4", "--layers", "2", "--hidden", "128"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    runs = [ln.split() for ln in lines if ln.startswith("0 ")]
    assert sorted(r[1] for r in runs) == ["bench", "bench2", "kvdiag"], lines
    assert all(r[7] == "40/0" and r[8] == "1280" for r in runs), runs
    counts = [ln for ln in lines if ln.startswith("failures:")]
    assert counts and "kvdiag 0 (SSE parse failures 0), bench 0" in counts[0], counts
    assert "output tokens per run kvdiag [1280], bench [1280]" in counts[0], counts
    assert lines[-1].startswith("RESULT ") and "parse_failures=0" in lines[-1]
