"""`kvdiag watch` where ptrace is refused: a simulated engine started with KVDIAG_AGENT=1 wedges under saturated
load in the seed's GIL cycle (the stock allocator's decode stall), and a watch running under a seccomp filter that
refuses ptrace and process_vm_readv (tests/fixtures/no_ptrace.py) names it through the in-process agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from steadyload import SteadyLoad, served_model

from kvdiag.agent.protocol import ENABLE_ENV
from kvdiag.allocator import remove_device_files
from kvdiag.capture.agent import armed
from kvdiag.sim.harness import SimProcess

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
pytestmark = pytest.mark.timeout(240)


def test_watch_names_a_gil_cycle_through_the_agent_where_ptrace_is_refused(tmp_path: Path) -> None:
    dev = f"kvagw{uuid.uuid4().hex[:10]}"
    sp = SimProcess(tmp_path / "server.log", preset="decode-stall", allocator="stock", device_name=dev,
                    env={ENABLE_ENV: "1"})
    env = {k: v for k, v in os.environ.items() if k != ENABLE_ENV}
    try:
        with sp:
            assert sp.wait_healthy(30), sp.log_text()[-2000:]
            core = sp.engine_core_pid()
            assert core is not None
            deadline = time.monotonic() + 20
            while armed(core)[0] is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert armed(core)[0] is not None, armed(core)[1]
            with SteadyLoad(sp.url, served_model(sp.url), streams=32, max_tokens=256, read_timeout_s=8):
                watch = subprocess.run(
                    [sys.executable, str(FIXTURES / "no_ptrace.py"), str(Path(sys.executable).parent / "kvdiag"),
                     "watch", "--url", sp.url, "--once", "--window", "3", "--period", "0.5", "--duration", "90",
                     "--out", str(tmp_path / "watch")],
                    capture_output=True, text=True, timeout=180, env=env)
    finally:
        remove_device_files(dev)
    out = watch.stdout + watch.stderr
    assert watch.returncode == 10, out[-4000:]
    verdict = next(json.loads(ln) for ln in watch.stdout.splitlines() if '"event": "verdict"' in ln)
    assert verdict["kind"] in ("gil_cycle", "decode_stall"), verdict
    report = json.loads((Path(verdict["out"]) / "report.json").read_text())
    assert "gil_cycle" in json.dumps(report["verdict"]), report["verdict"]["summary"]
    said = [f["message"] for f in report["findings"] if f["kind"] == "capture_path"]
    assert any(m.startswith(f"pid {core}: read through kvdiag's in-process agent") for m in said), said
    bundle = json.loads((Path(verdict["out"]) / "bundle" / "bundle.json").read_text())
    (proc,) = [p for p in bundle["processes"] if p["pid"] == core]
    tools = {t["tool"]: t for t in proc["tools"]}
    assert tools["agent"]["ok"] and tools["proc"]["ok"], tools
    assert not tools.get("pystack", {}).get("ok"), tools      # refused: the agent read it
