"""Run the kvdiag CLI as a user does (a subprocess) and read what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_kvdiag(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m kvdiag ARGS`` from the repo root, output captured, bounded by ``timeout``."""
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def read_report(out: Path) -> dict[str, object]:
    """The report.json of an output folder."""
    data = json.loads((out / "report.json").read_text())
    assert isinstance(data, dict)
    return data
