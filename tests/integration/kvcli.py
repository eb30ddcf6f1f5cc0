"""Run the kvdiag CLI as a user does (a subprocess) and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A `kind: command` engine that only answers /health with 200 (argv[1]: the port), standard library only.
HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def run_kvdiag(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m kvdiag ARGS`` from the repo root, output captured, bounded by ``timeout``."""
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def read_report(out: Path) -> dict[str, object]:
    """The report.json of an output folder."""
    data = json.loads((out / "report.json").read_text())
    assert isinstance(data, dict)
    return data


def assert_one_raw_layout(bundle_dir: Path) -> int:
    """Every raw tool output of the bundle sits at ``raw/<pid>/`` (kvdiag.bundle.io.raw_dir, the one layout
    of capture, repro, ab and soak) and exists; returns how many there are."""
    data = json.loads((bundle_dir / "bundle.json").read_text())
    n = 0
    for proc in data["processes"]:
        for run in proc["tools"]:
            if not run.get("raw_path"):
                continue
            parts = Path(run["raw_path"]).parts
            assert parts[:2] == ("raw", str(proc["pid"])) and len(parts) == 3, run["raw_path"]
            assert (bundle_dir / run["raw_path"]).is_file(), run["raw_path"]
            n += 1
    # nothing else under raw/: no per-engine folders beside the pid folders
    pids = {str(p["pid"]) for p in data["processes"]}
    raw = bundle_dir / "raw"
    if raw.is_dir():
        assert {d.name for d in raw.iterdir()} <= pids, sorted(d.name for d in raw.iterdir())
    return n


def marked_pids(marker: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries KVDIAG_TEST_MARKER=``marker``."""
    needle = f"KVDIAG_TEST_MARKER={marker}".encode()
    out = []
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            env = Path(f"/proc/{e}/environ").read_bytes()
            state = Path(f"/proc/{e}/stat").read_bytes().rsplit(b")", 1)[-1].split()[0]
        except OSError:
            continue
        if state != b"Z" and needle in env.split(b"\0"):
            out.append(int(e))
    return out
