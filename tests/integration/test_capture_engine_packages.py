"""`kvdiag capture --pid` records the package versions of the target's own Python (its venv), not kvdiag's.

A real venv (``python3 -m venv --without-pip``) with dist-info METADATA for vllm/kvcached/torch
written into its site-packages; a real Python process started from it; a real capture.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
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
