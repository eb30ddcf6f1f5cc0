"""Two kvdiag runs at once do not collide (ports, output folders, modelled device); busy ports are
reported clearly."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_runs_at_once_both_reproduce(tmp_path: Path) -> None:
    before = set(Path("/dev/shm").glob("kvdiag-*"))
    procs = [subprocess.Popen([sys.executable, "-m", "kvdiag", "repro", "two-engine"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 10, err[-2000:]
    runs = sorted((tmp_path / "reports").iterdir())
    assert len(runs) == 2  # default output folders never collide
    urls = set()
    devices: set[str] = set()
    for run in runs:
        text = (run / "report.json").read_text()
        devices |= set(re.findall(r"kvdiag-[0-9a-f]{12}", text))  # each run's own modelled device
        report = json.loads(text)
        assert report["verdict"]["kind"] == "gil_cycle"
        urls |= {e["url"] for e in report["engines"]}
    assert len(urls) == 4  # four engines, four distinct ports
    assert len(devices) == 2, devices  # the two runs did not share a device
    # Only these runs' files: other kvdiag runs on the machine may hold theirs right now.
    left = {p for p in set(Path("/dev/shm").glob("kvdiag-*")) - before if any(d in p.name for d in devices)}
    assert not left, f"per-run device files left behind: {sorted(left)}"


def test_port_in_use_is_a_clear_usage_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        scen = tmp_path / "p.yaml"
        scen.write_text(f"engines:\n  - name: a\n    port: {port}\n")
        proc = subprocess.run([sys.executable, "-m", "kvdiag", "repro", "two-engine", "--scenario", str(scen),
                               "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"port {port} is already in use" in proc.stderr and "Traceback" not in proc.stderr
