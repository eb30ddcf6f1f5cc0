"""`kvdiag watch --probe` beside a real vLLM CPU server that froze while idle (no request running, so vLLM's
gauges read 0 running / 0 waiting): a SIGSTOPped EngineCore is named `stopped` once the one-token canary goes
unanswered, /ready turns 503 and back to 200 once the engine answers again, while a passive watch beside it sees
nothing (the documented blind spot); then the GIL cycle KVDIAG_VLLM_STALL_AFTER_S arms is entered by the probe
request itself and named `gil_cycle`."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import VllmSetup

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from vllmserver import VllmServer  # noqa: E402
from watchproc import WatchProc  # noqa: E402

# Over a minute: a real vLLM start (20-40 s) and the injected GIL cycle, armed STALL_AFTER_S after the block pool
# so that the SIGSTOP part (probe period + window + capture, twice) is over first.
pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

WINDOW_S = 5.0
PROBE_PERIOD_S = 2.0
STALL_AFTER_S = 90.0     # counted from the block pool (before the server is ready): the SIGSTOP part comes first


def _ready(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5, trust_env=False).status_code


def _wait_ready(port: int, status: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _ready(port) == status:
            return True
        time.sleep(0.3)
    return False


def test_probe_names_an_engine_core_frozen_while_idle(vllm_setup: VllmSetup, tmp_path: Path) -> None:
    server = VllmServer(tmp_path / "vllm.log", stall_after_s=STALL_AFTER_S)
    watches: list[WatchProc] = []
    try:
        server.start()
        assert server.wait_ready(240), server.log_text()[-3000:]
        ready = time.monotonic()
        core = server.engine_core_pid()
        assert core is not None
        w = WatchProc("--url", server.url, "--probe", "--probe-period", f"{PROBE_PERIOD_S:g}", "--window",
                      f"{WINDOW_S:g}", "--period", "0.5", "--cooldown", "0", "--metrics-port", "0",
                      "--out", str(tmp_path / "out"))
        passive = WatchProc("--url", server.url, "--window", "2", "--period", "0.5", "--metrics-port", "0",
                            "--out", str(tmp_path / "out-passive"))
        watches += [w, passive]
        w.start()
        passive.start()
        start, pstart = w.wait_event("start", 60), passive.wait_event("start", 60)
        assert start is not None and pstart is not None, w.diag() + passive.diag()
        port = start["metrics_port"]
        assert w.wait_event("probe_answered", 30) is not None, w.diag()     # healthy and idle: answered

        # 1. SIGSTOP while idle: the probe goes unanswered, `stopped` is named, /ready 503.
        os.kill(core, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            stall = w.wait_event("stall", PROBE_PERIOD_S + WINDOW_S + 15)
            assert stall is not None, w.diag()
            assert stall["probe"] and stall["in_flight"] == 0 and stall["health"] == 200
            assert stall["engine_core"]["pid"] == core and stall["engine_core"]["state"] == "T"
            assert _ready(port) == 503
            verdict = w.wait_event("verdict", 60)
            assert verdict is not None and verdict["kind"] == "stopped" and str(core) in verdict["summary"], w.diag()
            took = time.monotonic() - stopped_at
            assert (Path(verdict["out"]) / "report.json").is_file() or w.wait_event("report", 30) is not None
            # the passive watch beside it saw nothing: 0 running / 0 waiting, /ready 200
            assert not passive.named("stall"), passive.diag()
            assert _ready(pstart["metrics_port"]) == 200
        finally:
            os.kill(core, signal.SIGCONT)
        assert _wait_ready(port, 200, PROBE_PERIOD_S + WINDOW_S + 15), w.diag()
        assert time.monotonic() - ready < STALL_AFTER_S - 5, "the SIGSTOP part ran into the injected stall"
        print(f"SIGSTOP -> verdict stopped: {took:.1f}s (probe period {PROBE_PERIOD_S:g}s, window {WINDOW_S:g}s)")

        # 2. The GIL cycle armed for the next request after STALL_AFTER_S: the probe itself enters it.
        verdict = None
        deadline = time.monotonic() + STALL_AFTER_S + 60
        while verdict is None and time.monotonic() < deadline:
            ev = w.wait_event("verdict", 5)
            if ev is not None and ev["kind"] == "gil_cycle":
                verdict = ev
        assert verdict is not None, w.diag() + server.log_text()[-2000:]
        stall = w.named("stall")[-1]
        assert stall["probe"] and stall["health"] == 200 and _ready(port) == 503
        print(f"GIL cycle: stall -> verdict {verdict['onset_to_verdict_s']}s after the probe was sent")
    finally:
        for proc in watches:
            proc.kill()
        server.stop()
