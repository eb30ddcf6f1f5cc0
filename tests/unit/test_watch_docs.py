"""docs/watch.md's systemd unit and Kubernetes sidecar, tried as far as this machine allows."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

DOC = Path(__file__).resolve().parents[2] / "docs" / "watch.md"


def _block(lang: str) -> str:
    m = re.search(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)
    assert m is not None, f"no {lang} block in {DOC}"
    return m.group(1)


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = _block("ini")
    assert "ExecStart=/usr/local/bin/kvdiag watch --url" in unit and "KillSignal=SIGTERM" in unit
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    # The unit as documented names a binary and a user this machine lacks: verify it with ours.
    path = tmp_path / "kvdiag-watch.service"
    path.write_text(unit.replace("/usr/local/bin/kvdiag", str(Path(sys.executable).parent / "python"))
                    .replace("User=vllm", "User=root"))
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_sidecar_shares_processes_and_may_ptrace() -> None:
    pod = yaml.safe_load(_block("yaml"))
    assert pod["kind"] == "Pod" and pod["spec"]["shareProcessNamespace"] is True
    (side,) = [c for c in pod["spec"]["containers"] if c["name"] == "kvdiag-watch"]
    assert side["args"][:3] == ["watch", "--url", "http://127.0.0.1:8000"]
    assert "SYS_PTRACE" in side["securityContext"]["capabilities"]["add"]
    port = side["args"][side["args"].index("--metrics-port") + 1]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == port


def test_the_serving_container_is_ready_from_the_watchs_progress() -> None:
    pod = yaml.safe_load(_block("yaml"))
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    side, serving = containers["kvdiag-watch"], containers["vllm"]
    assert "--probe" in side["args"]                 # an engine that froze while idle turns it 503 too
    probe = serving["readinessProbe"]["httpGet"]
    assert probe["path"] == "/ready" and str(probe["port"]) == side["args"][side["args"].index("--metrics-port") + 1]
    assert "livenessProbe" not in serving            # a restart would destroy the wedged process and its evidence
