"""`kvdiag watch` beside a real vLLM CPU server the test starts by hand (not kvdiag), under a small steady load:
a SIGSTOPped EngineCore is named `stopped`; then the GIL cycle KVDIAG_VLLM_STALL_AFTER_S injects into serving is
named `gil_cycle` within the window + 3 s of the last token while /health still says 200. The watch leaves every
process of the server as it found it (same pids, none stopped or traced by it)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import VllmSetup

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from steadyload import SteadyLoad, served_model, wait_engine_busy  # noqa: E402
from vllmserver import VllmServer  # noqa: E402
from watchproc import WatchProc  # noqa: E402

pytestmark = pytest.mark.timeout(420)

WINDOW_S = 4.0
STALL_AFTER_S = 90.0     # counted from the block pool (before the server is ready): the SIGSTOP part and the
#                          second watch's start must come first, on a busy machine too


def _status(pid: int) -> tuple[str, int]:
    """(state letter, TracerPid) of ``pid``."""
    state, tracer = "?", -1
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("State:"):
                state = line.split()[1]
            elif line.startswith("TracerPid:"):
                tracer = int(line.split()[1])
    return state, tracer


def _wait_tokens(load: SteadyLoad, more_than: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if load.tokens > more_than:
            return True
        time.sleep(0.2)
    return False


def test_watch_names_a_stopped_engine_core_then_an_injected_gil_cycle(vllm_setup: VllmSetup, tmp_path: Path) -> None:
    # More streams than the engine runs at once (one), and a real model's step time: the tiny model alone steps
    # faster than the API server streams, so its engine idles between requests and the gauges it last published
    # (a frozen EngineCore publishes nothing) read 0 in flight, invisible to /metrics. With 40 ms steps requests
    # queue in the engine, as they do in production, whenever the stall lands.
    server = VllmServer(tmp_path / "vllm.log", stall_after_s=STALL_AFTER_S, max_num_seqs=1, step_delay_ms=40)
    watches: list[WatchProc] = []
    try:
        server.start()
        assert server.wait_ready(240), server.log_text()[-3000:]
        ready = time.monotonic()
        core = server.engine_core_pid()
        assert core is not None
        load = SteadyLoad(server.url, served_model(server.url), streams=4, max_tokens=120, read_timeout_s=60).start()
        try:
            assert _wait_tokens(load, 0, 30), server.log_text()[-3000:]

            # 1. SIGSTOP: /health stays 200, the watch names `stopped` and leaves it stopped.
            w1 = WatchProc("--url", server.url, "--once", "--window", "3", "--period", "0.5", "--verbose",
                           "--out", str(tmp_path / "out-stop"))
            watches.append(w1)
            w1.start()
            assert w1.wait_event("start", 60) is not None, w1.diag()
            time.sleep(1.5)
            assert wait_engine_busy(server.url)     # stopped under load: the EngineCore has requests
            os.kill(core, signal.SIGSTOP)
            try:
                assert w1.wait(90) == 10, w1.diag()
                stall, verdict = w1.named("stall"), w1.named("verdict")
                assert stall and stall[0]["health"] == 200 and stall[0]["engine_core"]["state"] == "T", w1.diag()
                assert verdict and verdict[0]["kind"] == "stopped" and str(core) in verdict[0]["summary"], w1.diag()
                assert _status(core) == ("T", 0)
            finally:
                os.kill(core, signal.SIGCONT)
            seen = load.tokens
            assert _wait_tokens(load, seen, 20), "no token after SIGCONT"
            assert time.monotonic() - ready < STALL_AFTER_S - 8, "the SIGSTOP part ran into the injected stall"

            # 2. The injected GIL cycle: named gil_cycle within window + 3 s of the last token, /health 200.
            before = {pid: _status(pid) for pid in server.tree()}
            w2 = WatchProc("--url", server.url, "--once", "--window", f"{WINDOW_S:g}", "--period", "0.5", "--verbose",
                           "--out", str(tmp_path / "out-gil"))
            watches.append(w2)
            w2.start()
            assert w2.wait_event("start", 60) is not None, w2.diag()
            code = w2.wait(STALL_AFTER_S + 90)
            if code != 10 and _gauges_showed_nothing(w2):
                # vLLM's running/waiting gauges are published by the EngineCore itself: one that froze right after
                # an idle step leaves 0 in flight, which no passive watcher can tell from an idle server
                # (docs/watch.md). The SIGSTOP half above has been checked; this run cannot judge the stall half.
                pytest.skip("the injected stall froze the EngineCore while its gauges showed nothing in flight")
            assert code == 10, w2.diag() + server.log_text()[-2000:]
            (stall,), (verdict,) = w2.named("stall"), w2.named("verdict")
            assert verdict["kind"] == "gil_cycle", verdict
            assert stall["health"] == 200
            assert load.last_token_wall is not None
            late = verdict["unix"] - load.last_token_wall
            assert late <= WINDOW_S + 3.0, f"verdict {late:.2f}s after the last token (window {WINDOW_S:g}s)"
            report = Path(verdict["out"]) / "report.json"
            assert report.is_file()
            # left as found: the same processes, none stopped or traced
            after = {pid: _status(pid) for pid in server.tree()}
            assert set(after) == set(before)
            assert all(state not in ("T", "t") and tracer == 0 for state, tracer in after.values()), after
        finally:
            load.stop()
    finally:
        for w in watches:
            w.kill()
        server.stop()


def _gauges_showed_nothing(w: WatchProc) -> bool:
    """The watch's last progress lines all read 0 requests in flight (what /metrics said)."""
    looks = [line for line in w.stderr_lines if "in flight" in line][-5:]
    return bool(looks) and all("in flight 0," in line for line in looks)
