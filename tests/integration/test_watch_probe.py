"""`kvdiag watch --probe` beside a real simulated server whose EngineCore froze while idle (SIGSTOP, no request
running): without --probe the blind spot stands (0 running / 0 waiting reads as idle, /ready stays 200); with it
the one-token canary gets no answer within the window, the stall is named `stopped` with the EngineCore's frames,
/ready turns 503, and 200 again once a restarted server answers its probe. A healthy idle server answers every
probe (0 stalls)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from watchproc import WatchProc  # noqa: E402

from kvdiag.allocator import remove_device_files  # noqa: E402
from kvdiag.sim.harness import SimProcess  # noqa: E402

pytestmark = pytest.mark.timeout(180)

WINDOW_S = 5.0
PROBE_PERIOD_S = 1.0


def _sim(tmp_path: Path, dev: str, port: int | None = None, name: str = "server") -> SimProcess:
    sp = SimProcess(tmp_path / f"{name}.log", port=port, device_name=dev, startup_s=0.3, allocator="fixed")
    sp.start()
    assert sp.wait_healthy(60), sp.log_text()[-2000:]
    return sp


def _ready(port: int, engine: str | None = None) -> tuple[int, dict[str, object]]:
    path = "/ready" if engine is None else f"/ready/{engine}"
    resp = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
    return resp.status_code, resp.json()


def _wait_ready(port: int, status: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _ready(port)[0] == status:
            return True
        time.sleep(0.3)
    return False


def test_an_engine_core_stopped_while_idle_is_seen_only_with_probe(tmp_path: Path) -> None:
    dev = f"kvdiag-probe-{uuid.uuid4().hex[:8]}"
    first = _sim(tmp_path, dev, name="first")
    second: SimProcess | None = None
    engine = f"127.0.0.1:{first.port}"
    core = first.engine_core_pid()
    assert core is not None
    passive = WatchProc("--url", first.url, "--window", "2", "--period", "0.5", "--metrics-port", "0",
                        "--out", str(tmp_path / "out-passive"))
    w = WatchProc("--url", first.url, "--probe", "--probe-period", str(PROBE_PERIOD_S), "--window", str(WINDOW_S),
                  "--period", "0.5", "--metrics-port", "0", "--cooldown", "0", "--out", str(tmp_path / "out"))
    try:
        os.kill(core, signal.SIGSTOP)        # frozen with nothing running: the gauges read 0 / 0
        # 1. Passive: the documented blind spot (window + a few looks, no stall, ready).
        passive.start()
        start = passive.wait_event("start", 30)
        assert start is not None, passive.diag()
        time.sleep(2 + 3)
        assert not passive.named("stall") and not passive.named("probe"), passive.diag()
        assert _ready(start["metrics_port"])[0] == 200
        passive.terminate()
        assert passive.wait(20) == 0, passive.diag()

        # 2. --probe: the canary goes unanswered, the stall is captured and named like any other.
        w.start()
        start = w.wait_event("start", 30)
        assert start is not None, w.diag()
        port = start["metrics_port"]
        assert _ready(port)[0] == 200                    # idle, not probed yet
        t0 = time.monotonic()
        probe = w.wait_event("probe", 15)
        assert probe is not None and probe["id"].startswith("kvdiag-probe-"), w.diag()
        stall = w.wait_event("stall", WINDOW_S + 10)
        assert stall is not None, w.diag()
        assert stall["probe"]["id"] == probe["id"] and stall["in_flight"] == 0 and stall["health"] == 200
        assert stall["engine_core"]["pid"] == core and stall["engine_core"]["state"] == "T"
        status, body = _ready(port)
        assert status == 503 and body["engines"][engine]["ready"] is False, body   # type: ignore[index]
        assert _ready(port, engine)[0] == 503
        verdict = w.wait_event("verdict", 40)
        took = time.monotonic() - t0
        assert verdict is not None and verdict["kind"] == "stopped" and str(core) in verdict["summary"], w.diag()
        # probe period + window + capture (and a look period, on a loaded 2-core machine some slack)
        assert took < PROBE_PERIOD_S + WINDOW_S + 15, took
        print(f"watch start -> verdict stopped: {took:.1f}s (probe period {PROBE_PERIOD_S:g}s, window {WINDOW_S:g}s, "
              f"stall declared {stall['unix'] - probe['unix']:.1f}s after the probe)")
        assert w.wait_event("report", 30) is not None, w.diag()
        report = json.loads((Path(verdict["out"]) / "bundle" / "bundle.json").read_text())
        procs = {p["pid"]: p for p in report["processes"]}
        assert core in procs and any(t.get("frames") for t in procs[core]["threads"]), "no EngineCore frames"
        assert any(probe["id"] in (e.get("detail") or "") for e in report["timeline"]), report["timeline"]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert f'kvdiag_watch_probes_total{{engine="{engine}",outcome="failed"}} 1.0' in metrics
        assert f'kvdiag_watch_ready{{engine="{engine}"}} 0.0' in metrics

        # 3. A restart on the same port: the new server answers its probe, /ready is 200 again.
        first.stop()
        second = _sim(tmp_path, dev, port=first.port, name="second")
        assert w.wait_event("restart", 30) is not None, w.diag()
        answered = w.wait_event("probe_answered", 30)
        assert answered is not None and answered["latency_s"] < WINDOW_S, w.diag()
        assert _wait_ready(port, 200, 10), _ready(port)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert f'kvdiag_watch_probes_total{{engine="{engine}",outcome="answered"}}' in metrics
        assert "kvdiag_watch_probe_latency_seconds{" in metrics
        # healthy and idle: answered probes, no further stall, at most one probe per period
        time.sleep(3 * PROBE_PERIOD_S)
        assert len(w.named("stall")) == 1, w.diag()
        w.terminate()
        assert w.wait(20) == 0, w.diag()
    finally:
        passive.kill()
        w.kill()
        try:
            os.kill(core, signal.SIGCONT)
        except ProcessLookupError:
            pass
        first.stop()
        if second is not None:
            second.stop()
        remove_device_files(dev)
