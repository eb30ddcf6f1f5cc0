"""Real vLLM CPU, several at once on one host: two `kvdiag repro` runs of the vLLM scenario at the same time
(one stock, one fixed) beside a `vllm serve` started by hand. Every engine starts, each run gives its own
verdict, neither run leaves anything in /dev/shm or the temp dir, and the hand-started server keeps its
shared-memory files and keeps serving: kvdiag removes only what its own processes were seen holding."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import Leftovers, VllmSetup, assert_clean
from kvcli import read_report
from vllmserver import VllmServer

from kvdiag.osread.holders import device_of, held_ids

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "scenarios" / "two-engine-vllm-cpu.yaml"

# Five vLLM servers (two per run and the hand-started one) on a 2-core CI box: minutes, not seconds.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _shm_files(pids: list[int]) -> dict[tuple[int, int], str]:
    """The /dev/shm files ``pids`` map or hold, by identity, with their names now."""
    dev = device_of("/dev/shm")
    assert dev is not None
    ids: set[tuple[int, int]] = set()
    for pid in pids:
        ids |= held_ids(pid, {dev}) or set()
    out = {}
    for name in os.listdir("/dev/shm"):
        try:
            st = os.lstat(f"/dev/shm/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in ids:
            out[(st.st_dev, st.st_ino)] = name
    return out


def _answers(server: VllmServer) -> bool:
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 4},
                       timeout=60, trust_env=False)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and bool(r.json()["choices"])


def test_two_repros_beside_a_hand_started_server(vllm_setup: VllmSetup, leftovers: Leftovers,
                                                 tmp_path: Path) -> None:
    before = leftovers.snapshot()
    server = VllmServer(tmp_path / "hand.log", model=vllm_setup.model)
    runs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        server.start()
        assert server.wait_ready(400), server.log_text()[-3000:]
        assert _answers(server)
        theirs = _shm_files(server.tree())
        assert any(n.startswith("psm_") for n in theirs.values()), theirs   # vLLM's queues: live, not ours
        for side, extra in (("stock", []), ("fixed", ["--allocator", "fixed"])):
            with open(tmp_path / f"{side}.txt", "wb") as console:
                runs[side] = subprocess.Popen([sys.executable, "-m", "kvdiag", "repro", "two-engine", "--scenario",
                                               str(SCENARIO), *extra, "--out", str(tmp_path / side)],
                                              stdout=console, stderr=subprocess.STDOUT, cwd=ROOT,
                                              start_new_session=True)
        served_during = 0
        deadline = time.monotonic() + 1200
        while any(p.poll() is None for p in runs.values()) and time.monotonic() < deadline:
            served_during += _answers(server)
            time.sleep(5)
        codes = {side: p.wait(timeout=max(1.0, deadline - time.monotonic())) for side, p in runs.items()}
        text = {side: (tmp_path / f"{side}.txt").read_text(errors="replace")[-3000:] for side in runs}
        assert codes == {"stock": 10, "fixed": 0}, text

        stock, fixed = read_report(tmp_path / "stock"), read_report(tmp_path / "fixed")
        assert stock["verdict"]["kind"] == "gil_cycle" and stock["verdict"]["engine"] == "vlm", text  # type: ignore
        assert fixed["verdict"]["kind"] == "healthy", text   # type: ignore[index]
        for report in (stock, fixed):   # every engine of both runs came up (its EngineCore ran)
            for engine in report["engines"]:   # type: ignore[union-attr]
                assert engine["pids"].get("engine_core"), engine
        # The hand-started server: its files all there, the same files, and it still answers.
        assert server.popen is not None and server.popen.poll() is None
        after = _shm_files(server.tree())
        assert set(theirs) <= set(after), {k: v for k, v in theirs.items() if k not in after}
        assert served_during > 0 and _answers(server)
    finally:
        for p in runs.values():
            if p.poll() is None:
                p.kill()   # kvdiag alone: its reaper stops its engines
                p.wait()
        server.stop()
    assert_clean(leftovers, before)
