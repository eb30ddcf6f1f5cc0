"""The simulated seed (kvdiag repro two-engine) signs exactly like the seed's own stacks: kvcached #371."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEED_SIGNATURE = "gil_cycle-3716a34488aa"   # tests/unit/test_signature.py: the seed's stacks

pytestmark = pytest.mark.timeout(300)


def test_repro_two_engine_is_the_seed_signature_and_known(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "repro", "two-engine", "--out", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 10, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    verdict = report["verdict"]
    assert verdict["kind"] == "gil_cycle"
    assert verdict["signature"] == SEED_SIGNATURE
    assert verdict["known"]["id"] == "kvcached#371" and verdict["known"]["match"] == "signature"
    assert f"signature: {SEED_SIGNATURE}" in proc.stderr + proc.stdout
    assert "known: kvcached#371" in (out / "report.md").read_text()
    assert SEED_SIGNATURE in (out / "report.html").read_text()
    env = report["environment"]
    assert env["python"] and env["kernel"] and "kvcached" in env["packages"]
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    assert bundle["environment"]["os"] == env["os"]
