"""`kvdiag watch` beside real simulated servers the test starts itself (kvdiag does not launch them):
a SIGSTOPped EngineCore under load is a stall named `stopped` and left as found; the watch goes on,
serves its Prometheus metrics, and stops cleanly on SIGTERM; a server restarted on the same port is
one event and the watch goes on judging the new one."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from steadyload import SteadyLoad, served_model  # noqa: E402
from watchproc import WatchProc  # noqa: E402

from kvdiag.allocator import remove_device_files
from kvdiag.sim.harness import SimProcess  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _tracer(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return -1


def _sim(tmp_path: Path, dev: str, port: int | None = None, name: str = "server") -> SimProcess:
    sp = SimProcess(tmp_path / f"{name}.log", port=port, device_name=dev, startup_s=0.3, allocator="fixed")
    sp.start()
    assert sp.wait_healthy(60), sp.log_text()[-2000:]
    return sp


def test_a_stopped_engine_core_is_named_and_the_watch_goes_on(tmp_path: Path) -> None:
    dev = f"kvdiag-watch-{uuid.uuid4().hex[:8]}"
    sp = _sim(tmp_path, dev)
    w = WatchProc("--url", sp.url, "--window", "2", "--out", str(tmp_path / "out"), "--metrics-port", "0",
                  "--period", "0.5")
    core = sp.engine_core_pid()
    assert core is not None
    try:
        with SteadyLoad(sp.url, served_model(sp.url), streams=2, max_tokens=64) as load:
            w.start()
            start = w.wait_event("start", 30)
            assert start is not None, w.diag()
            assert start["engine_core_pid"] == core and start["server_pid"] == sp.pid
            time.sleep(1.5)
            assert load.tokens > 0
            os.kill(core, signal.SIGSTOP)
            try:
                stall = w.wait_event("stall", 20)
                assert stall is not None, w.diag()
                assert stall["health"] == 200                      # /health says nothing of it
                assert stall["engine_core"]["state"] == "T" and stall["capture"] is True
                verdict = w.wait_event("verdict", 40)
                assert verdict is not None, w.diag()
                assert verdict["kind"] == "stopped", verdict
                assert str(core) in verdict["summary"]
                assert isinstance(verdict["stall_to_verdict_s"], float), verdict   # was null
                report = w.wait_event("report", 30)
                assert report is not None and report["out"] == verdict["out"], w.diag()
                assert (Path(verdict["out"]) / "report.json").is_file()
                assert (Path(verdict["out"]) / "bundle" / "bundle.json").is_file()
                # left as found: still stopped by us, traced by nobody
                assert _state(core) == "T" and _tracer(core) == 0
                metrics = httpx.get(f"http://127.0.0.1:{start['metrics_port']}/metrics", timeout=5).text
                engine = f'engine="127.0.0.1:{sp.port}",kind="stopped"'
                assert f"kvdiag_watch_stalls_total{{{engine}}} 1.0" in metrics
                assert f"kvdiag_watch_last_verdict{{{engine}}} 1.0" in metrics
            finally:
                os.kill(core, signal.SIGCONT)
            recovered = w.wait_event("recovered", 20)
            assert recovered is not None and recovered["what"] == "stall", w.diag()
        w.terminate(signal.SIGTERM)
        assert w.wait(20) == 0, w.diag()
        stop = w.named("stop")
        assert stop and stop[-1]["reason"] == "received SIGTERM"
        assert len(w.named("stall")) == 1 and len(w.named("verdict")) == 1
        assert _state(core) in ("S", "R") and _tracer(core) == 0 and sp.returncode() is None
    finally:
        w.kill()
        sp.stop()
        remove_device_files(dev)


def test_a_restart_is_one_event_and_the_watch_judges_the_new_server(tmp_path: Path) -> None:
    dev = f"kvdiag-watch-{uuid.uuid4().hex[:8]}"
    first = _sim(tmp_path, dev, name="first")
    second: SimProcess | None = None
    out = tmp_path / "out"
    w = WatchProc("--url", first.url, "--window", "2", "--out", str(out), "--period", "0.5", "--keep", "1")
    try:
        w.start()
        start = w.wait_event("start", 30)
        assert start is not None and start["server_pid"] == first.pid, w.diag()
        first.stop()
        assert w.wait_event("error", 15) is not None, w.diag()          # unreachable: reported, not fatal
        second = _sim(tmp_path, dev, port=first.port, name="second")
        restart = w.wait_event("restart", 30)
        assert restart is not None, w.diag()
        assert f"API server pid {first.pid} -> {second.pid}" in " ".join(restart["reasons"])
        new_core = second.engine_core_pid()
        assert new_core is not None and restart["engine_core_pid"] == new_core
        # the watch goes on: a stall of the new server is named, on the new EngineCore
        with SteadyLoad(second.url, served_model(second.url), streams=2, max_tokens=64) as load:
            deadline = time.monotonic() + 10
            while load.tokens == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)
            os.kill(new_core, signal.SIGSTOP)
            try:
                verdict = w.wait_event("verdict", 40)
            finally:
                os.kill(new_core, signal.SIGCONT)
        assert verdict is not None and verdict["kind"] == "stopped" and str(new_core) in verdict["summary"], w.diag()
        w.terminate(signal.SIGHUP)
        assert w.wait(20) == 0, w.diag()
        assert len(w.named("restart")) == 1 and w.named("stop")[-1]["reason"] == "received SIGHUP"
        assert len([p for p in out.iterdir() if p.name.startswith("stall-")]) == 1
    finally:
        w.kill()
        first.stop()
        if second is not None:
            second.stop()
        remove_device_files(dev)
