"""`kvdiag sweep` on the simulated engines, for real: every cell a full repro whose engines really hang.

A 2 x 2 x 2 grid (pool pages x min_reserved_pages x allocator) must give the seed's rule with every cell
right and the fixed allocator never hanging; a sweep interrupted with SIGINT keeps its finished cells and
the same command continues it. Nothing is left behind: no process, no file in the sweep's TMPDIR, no
modelled-device file in /dev/shm.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kvcli import marked_pids as _marked

from kvdiag.allocator import native_module

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
PAGES = "engines.vlm.sim.kv_per_layer_mb=2,4"          # 1 and 2 pages of 2 MB per layer
RESERVE = "engines.vlm.sim.min_reserved_pages=1,2"


def _env(tmp: Path, marker: str) -> dict[str, str]:
    (tmp / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp / "tmp"), "KVDIAG_TEST_MARKER": marker}


def _sweep(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvdiag", "sweep", *args]


def _assert_nothing_left(out: Path, tmp: Path, marker: str) -> None:
    deadline = time.monotonic() + 10
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _marked(marker) == []
    assert list((tmp / "tmp").iterdir()) == []
    native = native_module()
    devices = {m for log in out.glob("cells/*/run-*/bundle/logs/*.log")
               for m in re.findall(r"device=(\S+?),", log.read_text(errors="replace"))}
    assert devices, "the engines' logs name their modelled device"
    for name in devices:
        for path in (native.device_account_path(name), native.device_lock_path(name)):
            assert not os.path.exists(path), path


def test_a_small_sweep_recovers_the_seed_rule_and_the_fix(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    out = tmp_path / "sweep"
    proc = subprocess.run(_sweep(["--vary", PAGES, "--vary", RESERVE, "--vary", "allocator=stock,fixed",
                                  "--out", str(out), "--jobs", "2"]),
                          capture_output=True, text=True, timeout=280, cwd=ROOT, env=_env(tmp_path, marker))
    assert proc.returncode == 10, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["schema_version"] == "1" and report["report_kind"] == "sweep" and report["finished"]
    assert len(report["cells"]) == 8
    for cell in report["cells"]:
        p = cell["params"]
        pages = int(p["kv_per_layer_mb"]) // 2
        hangs = p["allocator"] == "stock" and pages <= p["min_reserved_pages"]
        assert cell["outcome"] == ("hang" if hangs else "healthy"), cell
        run = cell["runs"][0]
        if hangs:
            assert run["verdict"] == "gil_cycle" and run["signature"] == "gil_cycle-3716a34488aa", run
            assert run["engine"] == "vlm" and run["time_to_hang_s"] is not None
        else:
            assert run["verdict"] == "healthy" and run["time_to_healthy_s"] is not None, run
        assert (out / run["path"] / "report.html").is_file()
        assert (out / "cells" / cell["key"] / "cell.json").is_file()
    rule = report["rule"]
    assert rule["fits"] and rule["text"] == ("hangs ⇔ allocator stock and pages per layer ≤ min_reserved_pages "
                                             "(engine vlm)"), rule
    assert report["banner_check"]["agree"], report["banner_check"]
    html = (out / "report.html").read_text()
    assert "pages per layer ≤ min_reserved_pages" in html and "grid-template-columns" in html
    assert not re.search(r"""(src|href)=["']https?:""", html)   # self-contained
    assert "hangs ⇔" in proc.stdout and "report.html" in proc.stdout   # the verdict on stdout
    assert "left" in proc.stderr and "hung so far" in proc.stderr       # progress on stderr
    (out / "report.html").unlink()
    again = subprocess.run([sys.executable, "-m", "kvdiag", "report", str(out)], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    assert again.returncode == 0 and (out / "report.html").read_text() == html   # rendered from report.json
    _assert_nothing_left(out, tmp_path, marker)


def test_an_interrupted_sweep_keeps_its_cells_and_continues(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    out = tmp_path / "sweep"
    args = ["--vary", PAGES, "--vary", RESERVE, "--out", str(out), "--jobs", "1"]
    env = _env(tmp_path, marker)
    proc = subprocess.Popen(_sweep(args), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("cells/*/cell.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(out.glob("cells/*/cell.json")), "no cell finished"
        time.sleep(1.0)   # the next cell's run is under way
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stdout + stderr
    first = json.loads((out / "report.json").read_text())
    assert first["interrupted"] and not first["finished"]
    kept = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("cells/*/cell.json")}
    assert 1 <= len(kept) < 4
    assert "--resume" in stdout
    _assert_nothing_left(out, tmp_path, marker)

    again = subprocess.run(_sweep(["--resume", "--out", str(out)]), capture_output=True, text=True,
                           timeout=200, cwd=ROOT, env=env)
    assert again.returncode == 10, again.stdout + again.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["finished"] and len(report["cells"]) == 4
    assert f"{len(kept)} cell(s) were already finished" in again.stderr
    for key, mtime in kept.items():   # finished cells were not run again
        assert (out / "cells" / key / "cell.json").stat().st_mtime_ns == mtime
    assert report["rule"]["text"] == "hangs ⇔ pages per layer ≤ min_reserved_pages (engine vlm)"
    _assert_nothing_left(out, tmp_path, marker)


def test_a_verdict_from_a_too_short_window_is_confirmed_with_the_scenarios_own(tmp_path: Path) -> None:
    """An engine sleeping through a slow start outlasts a 0.5 s window and is captured naming no deadlock
    (`unknown`); the sweep runs it again with the scenario's 5 s window, where it starts healthy."""
    marker = uuid.uuid4().hex
    out = tmp_path / "sweep"
    proc = subprocess.run(_sweep(["--engines", "vlm", "--stall-window", "0.5", "--vary", "engines.vlm.sim.startup_s=3",
                                  "--vary", "engines.vlm.sim.min_reserved_pages=1", "--out", str(out)]),
                          capture_output=True, text=True, timeout=200, cwd=ROOT, env=_env(tmp_path, marker))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    (cell,) = report["cells"]
    assert cell["outcome"] == "healthy" and cell["runs"][0]["verdict"] == "healthy", cell
    assert report["engines_left_out"] == ["coder"]
    first = out / "cells" / cell["key"] / "run-0-inconclusive-1"
    assert json.loads((first / "report.json").read_text())["verdict"]["kind"] != "healthy"   # its evidence kept
    assert "running it again with a 5s stall window" in proc.stderr
    _assert_nothing_left(out, tmp_path, marker)
