"""The {port} placeholder on a `kind: command` engine, on the simulated engine.

A command that uses {port} is reached on the port kvdiag chose, and that port is in the report; a
command that ignores it (listens on a port of its own) ends the run with a clear error naming both
ports, not a startup timeout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvcli import read_report, run_kvdiag

from kvdiag.ports import free_port


def _scenario(tmp: Path, port_arg: str, device: str) -> Path:
    path = tmp / "s.yaml"
    path.write_text(f"""
windows: {{stall_s: 20, startup_timeout_s: 90, timeout_s: 150, kill_grace_s: 2}}
capture: {{when: never}}
engines:
  - name: cmd
    kind: command
    port: 0
    command: [{sys.executable}, -m, kvdiag.sim, serve, --port, "{port_arg}", --allocator, fixed,
              --device-name, {device}, --startup-s, "0.5"]
    expect: healthy
""")
    return path


def _cleanup(device: str) -> None:
    from kvdiag.allocator import remove_device_files

    remove_device_files(device)


def test_port_placeholder_reaches_the_chosen_port(tmp_path: Path) -> None:
    device = f"kvdiag-ut-port-{os.getpid()}-a"
    out = tmp_path / "out"
    try:
        proc = run_kvdiag("repro", "two-engine", "--scenario", str(_scenario(tmp_path, "{port}", device)),
                          "--out", str(out), timeout=200)
    finally:
        _cleanup(device)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = read_report(out)
    engine = report["engines"][0]  # type: ignore[index]
    url = str(engine["url"])
    port = int(url.rsplit(":", 1)[1])
    assert engine["healthy"] is True and port > 0
    launched = [e for e in report["timeline"] if e["event"] == "launched"]  # type: ignore[union-attr]
    assert f":{port}" in launched[0]["detail"]


def test_a_command_that_ignores_the_port_gets_a_clear_error(tmp_path: Path) -> None:
    device = f"kvdiag-ut-port-{os.getpid()}-b"
    own_port = free_port()
    try:
        proc = run_kvdiag("repro", "two-engine", "--scenario", str(_scenario(tmp_path, str(own_port), device)),
                          "--out", str(tmp_path / "out"), timeout=200)
    finally:
        _cleanup(device)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 4, text[-3000:]
    assert f"listens on port {own_port}" in text and "{port}" in text
    assert "Traceback" not in text
