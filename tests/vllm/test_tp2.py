"""Real vLLM CPU with tensor parallelism 2 (API server -> EngineCore -> Worker_TP0, Worker_TP1): kvdiag's plugin
hangs rank 1 in its worker while serving, and `repro` names that rank with its frames and the chain of waits
from the API server; the healthy TP=2 engine soaks healthy; nothing is left in /tmp or /dev/shm."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import Leftovers, VllmSetup, assert_clean
from kvcli import read_report, run_kvdiag

ROOT = Path(__file__).resolve().parents[2]


def test_tp2_stuck_rank_named_with_its_frames_and_the_chain(vllm_setup: VllmSetup, leftovers: Leftovers,
                                                             tmp_path: Path) -> None:
    before = leftovers.snapshot()
    out = tmp_path / "tp2"
    proc = run_kvdiag("repro", "two-engine", "--scenario", str(ROOT / "scenarios" / "tp2-vllm-cpu.yaml"),
                      "--out", str(out), timeout=900)
    assert proc.returncode == 10, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = read_report(out)
    verdict = report["verdict"]
    assert isinstance(verdict, dict)
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    by_title = {(p["cmdline"] or [p["comm"]])[0].strip("\0 "): p for p in bundle["processes"]}
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(by_title), sorted(by_title)
    api = next(p for p in bundle["processes"] if p["role"] == "api_server")
    core, tp0, tp1 = (by_title[t]["pid"] for t in ("VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"))
    # The stuck rank, named with its frames: the GIL cycle inside Worker.execute_model of rank 1.
    assert verdict["kind"] == "gil_cycle" and verdict["engine"] == "tp2", verdict["summary"]
    assert f"pid {tp1} (Worker_TP1 of engine tp2)" in verdict["summary"], verdict["summary"]
    cited = [e for e in verdict["evidence"] if e["pid"] == tp1]
    frames = " ".join(" ".join(e["frames"]) for e in cited)
    assert "alloc_page" in frames and "take_null_block" in frames and "execute_model" in frames, frames
    # The chain from the API server: ZMQ to the EngineCore, the response ring to rank 0, rank 0's collective to
    # rank 1, which never arrived.
    waits = verdict["waits"]
    assert waits is not None, verdict["summary"]
    pids = [e["src"]["pid"] for e in waits["edges"]] + [waits["edges"][-1]["dst"]["pid"]]
    assert pids == [api["pid"], core, tp0, tp1], (pids, verdict["summary"])
    assert [e["kind"] for e in waits["edges"]] == ["zmq", "shm_ring", "collective"], waits["edges"]
    assert waits["root"]["pid"] == tp1 and waits["root_state"] == "hung"
    events = [e["event"] for e in report["timeline"]]  # type: ignore[union-attr]
    assert "first request answered" in events and "stall detected" in events
    assert_clean(leftovers, before)


def test_tp2_healthy_under_soak(vllm_setup: VllmSetup, leftovers: Leftovers, tmp_path: Path) -> None:
    before = leftovers.snapshot()
    out = tmp_path / "soak"
    proc = run_kvdiag("soak", "--scenario", str(ROOT / "scenarios" / "soak-tp2-vllm-cpu.yaml"), "--duration", "8",
                      "--out", str(out), timeout=900)
    kind = read_report(out)["verdict"]["kind"]  # type: ignore[index]
    assert (proc.returncode, kind) in ((0, "healthy"), (0, "slow_start"), (6, "not_saturated")), proc.stdout[-4000:]
    assert_clean(leftovers, before)


def test_tp2_rank_in_another_collective_is_a_collective_mismatch(vllm_setup: VllmSetup, leftovers: Leftovers,
                                                                 tmp_path: Path) -> None:
    """Rank 1 takes a rank-local branch (a barrier rank 0 never calls) while rank 0 goes into the forward
    pass's all-reduce: `repro` names collective_mismatch with both ranks' frames."""
    before = leftovers.snapshot()
    out = tmp_path / "tp2m"
    proc = run_kvdiag("repro", "two-engine", "--scenario", str(ROOT / "scenarios" / "tp2-vllm-cpu-mismatch.yaml"),
                      "--out", str(out), timeout=900)
    assert proc.returncode == 10, proc.stdout[-4000:] + proc.stderr[-2000:]
    verdict = read_report(out)["verdict"]
    assert isinstance(verdict, dict)
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    by_title = {(p["cmdline"] or [p["comm"]])[0].strip("\0 "): p for p in bundle["processes"]}
    tp0, tp1 = (by_title[t]["pid"] for t in ("VLLM::Worker_TP0", "VLLM::Worker_TP1"))
    summary = verdict["summary"]
    assert verdict["kind"] == "collective_mismatch", summary
    assert "rank TP1 is in barrier" in summary and "rank_local_barrier" in summary, summary
    assert "rank TP0 waits in" in summary and "all_reduce" in summary, summary
    assert {tp0, tp1} <= {e["pid"] for e in verdict["evidence"]}
    # The chain from the API server: ZMQ to the EngineCore, the response ring to rank 0, its all-reduce to rank 1.
    api = next(p["pid"] for p in bundle["processes"] if p["role"] == "api_server")
    waits = verdict["waits"]
    assert waits is not None, summary
    pids = [e["src"]["pid"] for e in waits["edges"]] + [waits["edges"][-1]["dst"]["pid"]]
    assert pids == [api, by_title["VLLM::EngineCore"]["pid"], tp0, tp1], (pids, summary)
    assert [e["kind"] for e in waits["edges"]] == ["zmq", "shm_ring", "collective"], waits["edges"]
    assert_clean(leftovers, before)
