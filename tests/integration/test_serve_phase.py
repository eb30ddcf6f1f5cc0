"""A scenario's serving phase on a simulated engine: requests after startup, counted, no stall."""

from __future__ import annotations

from pathlib import Path

from kvcli import read_report, run_kvdiag

SCENARIO = """
name: serve-sim
windows: {stall_s: 5, startup_timeout_s: 60, timeout_s: 120, kill_grace_s: 2}
serve: {duration_s: 2, max_tokens: 4}
engines:
  - name: sim1
    allocator: fixed
    sim: {layers: 2, kv_per_layer_mb: 16, max_running: 4}
"""


def test_serving_phase_answers_and_stays_healthy(tmp_path: Path) -> None:
    scen = tmp_path / "serve.yaml"
    scen.write_text(SCENARIO)
    out = tmp_path / "out"
    proc = run_kvdiag("repro", "two-engine", "--scenario", str(scen), "--out", str(out), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    events = [e["event"] for e in read_report(out)["timeline"]]  # type: ignore[union-attr]
    assert "first request answered" in events and "served" in events and "stall detected" not in events
