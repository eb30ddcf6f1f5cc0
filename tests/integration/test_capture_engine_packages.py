"""`kvdiag capture --pid` records the package versions of the target's own Python (its venv), not kvdiag's.

A real venv (``python3 -m venv --without-pip``) with dist-info METADATA for vllm/kvcached/torch
written into its site-packages; a real Python process started from it; a real capture.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import setproctitle
from kvcli import run_kvdiag

pytestmark = pytest.mark.timeout(300)

FAKE = {"vllm": "0.32.0+fake", "kvcached": "0.1.6+fake", "torch": "2.9.0+cu128"}


def _venv_with_fake_packages(root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site = next(root.glob("lib/python3*/site-packages"))
    for name, version in FAKE.items():
        d = site / f"{name}-{version}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8")
    return root / "bin" / "python"


def test_capture_pid_reports_the_targets_venv_versions(tmp_path: Path) -> None:
    python = _venv_with_fake_packages(tmp_path / "venv")
    target = subprocess.Popen([str(python), "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        out = tmp_path / "out"
        proc = run_kvdiag("capture", "--pid", str(target.pid), "--tools", "proc", "--out", str(out))
        assert "Traceback" not in proc.stderr, proc.stderr
        env = json.loads((out / "bundle" / "bundle.json").read_text())["environment"]
        [ip] = env["engine_packages"]
        assert ip["who"] == f"pid {target.pid}"
        assert ip["python"] == str(python)                  # the venv's python, not the base it links to
        assert ip["source"] == "asked the interpreter"
        assert {k: ip["packages"][k] for k in FAKE} == FAKE
        assert env["packages"]["vllm"] != FAKE["vllm"]       # kvdiag's own versions stay kvdiag's
        md = (out / "report.md").read_text()
        assert f"packages of pid {target.pid}" in md and "vllm 0.32.0+fake" in md
        assert "0.32.0+fake" in (out / "report.html").read_text()
    finally:
        target.kill()
        target.wait(timeout=10)


def test_capture_of_a_retitled_process_reads_the_venv_it_runs_in(tmp_path: Path) -> None:
    # vLLM's EngineCore sets its title over its argv ("VLLM::EngineCore"), and /proc/PID/exe is the base
    # python a venv links to: the venv is found from what the process has mapped out of its site-packages.
    python = _venv_with_fake_packages(tmp_path / "venv")
    site = next((tmp_path / "venv").glob("lib/python3*/site-packages"))
    shutil.copytree(Path(setproctitle.__file__).parent, site / "setproctitle")
    code = ("import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); print('ready', flush=True); "
            "time.sleep(600)")
    target = subprocess.Popen([str(python), "-I", "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True, cwd=tmp_path)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        assert Path(f"/proc/{target.pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")
        out = tmp_path / "out"
        proc = run_kvdiag("capture", "--pid", str(target.pid), "--tools", "proc", "--out", str(out))
        assert "Traceback" not in proc.stderr, proc.stderr
        [ip] = json.loads((out / "bundle" / "bundle.json").read_text())["environment"]["engine_packages"]
        assert Path(ip["python"]).parent == python.parent, ip["python"]   # the venv's, not the base python
        assert {k: ip["packages"][k] for k in FAKE} == FAKE
    finally:
        target.kill()
        target.wait(timeout=10)
