"""kvdiag never touches what is not its own: a bystander program keeps live files in /dev/shm (spawn-start
locks, a shared-memory block, plain files, some named like an engine's leftovers) made before, during and
after each command, and all of them survive every command and the reaper of a SIGKILLed kvdiag; the
bystander's spawned child still opens its locks. The leftovers of an engine kvdiag started (a fake engine
killed with its resource tracker, its psm_* block and sem.mp-* lock left behind) are still removed.

One bystander serves every test of the module (as one long-lived service would beside many runs).
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import reaper_run_id, wait_for
from steadyload import SteadyLoad, served_model
from watchproc import WatchProc

from kvdiag.allocator import remove_device_files
from kvdiag.sim.harness import SimProcess

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")]
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"

# The embedded two-engine hang, plus a fake engine that leaves psm_* and sem.mp-* behind when killed.
LEAKY_SCENARIO = f"""
name: two-engine-leaky
windows: {{stall_s: 5, startup_timeout_s: 60, timeout_s: 120, kill_grace_s: 1}}
device: {{size_gb: 96}}
engines:
  - name: leaky
    kind: command
    command: ["{sys.executable}", "{FIXTURES / 'engines' / 'leaky.py'}", "--max-life", "200"]
    ready: "log:READY"
  - name: coder
    model: sim/coder
    start_after: leaky
    env: {{KVCACHED_IPC_NAME: CODER, KVCACHED_PAGE_SIZE_MB: "2"}}
    sim: {{layers: 64, kv_per_layer_mb: 283, page_size_mb: 2, min_reserved_pages: 5, max_reserved_pages: 10,
          weights_gb: 33, gpu_memory_utilization: 0.74}}
  - name: vlm
    model: sim/vlm
    start_after: coder
    env: {{KVCACHED_IPC_NAME: VLMM, KVCACHED_PAGE_SIZE_MB: "2"}}
    sim: {{layers: 28, kv_per_layer_mb: 11, page_size_mb: 2, min_reserved_pages: 5, max_reserved_pages: 5,
          weights_gb: 16, gpu_memory_utilization: 0.20}}
    expect: hang
"""




class Bystander:
    """tests/fixtures/bystander.py in its own session: not started by kvdiag, not a child of it."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen([sys.executable, str(FIXTURES / "bystander.py"), "--max-life", "900"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      start_new_session=True)
        self.files: list[str] = []

    def _ask(self, cmd: str) -> dict[str, Any]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(cmd + "\n")
        self.popen.stdin.flush()
        answer: dict[str, Any] = json.loads(self.popen.stdout.readline())
        return answer

    def make(self) -> None:
        self.files += self._ask("make")["files"]

    def assert_untouched(self) -> None:
        missing = [f for f in self.files if not os.path.exists(f)]
        assert not missing, f"bystander files removed: {missing}"
        assert self.popen.poll() is None
        check = self._ask("check")
        assert check["ok"], f"the bystander's child could not open its locks and blocks: {check}"

    def close(self) -> None:
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@pytest.fixture(scope="module")
def bystander() -> Iterator[Bystander]:
    by = Bystander()
    by.make()   # before any command
    try:
        yield by
    finally:
        by.close()


def _kvdiag(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvdiag", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _around(by: Bystander, proc: subprocess.Popen[str], during: Callable[[], object], timeout: float = 200
            ) -> tuple[int, str]:
    """Make bystander files once ``during`` says the command is under way, wait for it, make more after."""
    try:
        assert wait_for(during, 90), "the command never got under way"
        by.make()
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    by.make()
    return proc.returncode, out + err


def _engine_leaks(out: Path) -> list[str]:
    """The /dev/shm files the leaky engine said it made (its log, copied into the bundle)."""
    text = "".join(p.read_text(errors="replace") for p in out.glob("**/bundle/logs/leaky*.log"))
    return [p for m in re.finditer(r"^LEAKS (.+)$", text, re.M) for p in m.group(1).split()]


def _scenario(tmp_path: Path) -> Path:
    path = tmp_path / "leaky.yaml"
    path.write_text(LEAKY_SCENARIO)
    return path


def test_repro_removes_its_engines_leftovers_and_nothing_of_the_bystanders(bystander: Bystander,
                                                                            tmp_path: Path) -> None:
    out = tmp_path / "repro"
    proc = _kvdiag("repro", "two-engine", "--scenario", str(_scenario(tmp_path)), "--out", str(out))
    rc, text = _around(bystander, proc, lambda: reaper_run_id(proc.pid))
    assert rc == 10, text
    leaks = _engine_leaks(out)
    assert len(leaks) == 2, text
    assert wait_for(lambda: not any(os.path.exists(p) for p in leaks), 10), f"engine leftovers kept: {leaks}"
    bystander.assert_untouched()
    # The bystander's unused files named like leftovers were made during the run: named, never removed.
    assert "left in /dev/shm" in text and "psm_by" in text


def test_the_reaper_of_a_sigkilled_kvdiag_removes_only_its_engines_files(bystander: Bystander,
                                                                        tmp_path: Path) -> None:
    out = tmp_path / "killed"
    proc = _kvdiag("repro", "two-engine", "--scenario", str(_scenario(tmp_path)), "--out", str(out))
    leaks: list[str] = []
    run_id: str | None = None
    try:
        assert wait_for(lambda: reaper_run_id(proc.pid), 60), "kvdiag never started its reaper"
        run_id = reaper_run_id(proc.pid)
        assert run_id
        assert wait_for(lambda: len(_marked_leaks(run_id or "")) == 2, 60), "the leaky engine never came up"
        leaks = _marked_leaks(run_id)
        bystander.make()
        time.sleep(1.0)   # kvdiag has looked at its engines' files at least once
        os.kill(proc.pid, signal.SIGKILL)   # kvdiag alone: its engines and reaper are in their own sessions
        proc.wait(timeout=30)
        bystander.make()
        assert wait_for(lambda: reaper_run_id(proc.pid) is None, 60), "the reaper never finished"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if run_id is not None:
            remove_device_files(f"kvdiag-{run_id}")
    assert not any(os.path.exists(p) for p in leaks), f"engine leftovers kept: {leaks}"
    bystander.assert_untouched()


def _marked_leaks(run_id: str) -> list[str]:
    """The /dev/shm files the leaky engine of the run (a process with the run's marker) maps, found by
    identity: its lock's mapping carries glibc's temporary name, not the file's."""
    needle = f"KVDIAG_RUN_ID={run_id}".encode()
    inodes: set[int] = set()
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{e}/environ").read_bytes().split(b"\0"):
                continue
            if b"leaky.py" not in Path(f"/proc/{e}/cmdline").read_bytes():
                continue
            maps = Path(f"/proc/{e}/maps").read_text()
        except OSError:
            continue
        inodes.update(int(line.split()[4]) for line in maps.splitlines() if "/dev/shm/" in line)
    found = []
    for name in os.listdir("/dev/shm"):
        try:
            if os.lstat(f"/dev/shm/{name}").st_ino in inodes:
                found.append(f"/dev/shm/{name}")
        except OSError:
            continue
    return sorted(found)


def test_soak_and_ab_leave_the_bystander_alone(bystander: Bystander, tmp_path: Path) -> None:
    soak = _kvdiag("soak", "--model", "sim", "--allocator", "fixed", "--duration", "3", "--out", str(tmp_path / "s"))
    rc, text = _around(bystander, soak, lambda: reaper_run_id(soak.pid))
    assert rc == 0, text
    bystander.assert_untouched()
    ab = _kvdiag("ab", "--out", str(tmp_path / "ab"))
    rc, text = _around(bystander, ab, lambda: reaper_run_id(ab.pid))
    assert rc in (0, 10), text
    bystander.assert_untouched()


def test_a_two_cell_sweep_leaves_the_bystander_alone(bystander: Bystander, tmp_path: Path) -> None:
    sweep = _kvdiag("sweep", "--vary", "allocator=stock,fixed", "--jobs", "2", "--out", str(tmp_path / "sw"))
    rc, text = _around(bystander, sweep, lambda: (tmp_path / "sw" / "cells").is_dir())
    assert rc == 10, text
    bystander.assert_untouched()


def test_watch_once_leaves_the_bystander_alone(bystander: Bystander, tmp_path: Path) -> None:
    dev = f"kvdiag-by-{uuid.uuid4().hex[:8]}"
    sp = SimProcess(tmp_path / "server.log", device_name=dev, startup_s=0.3, allocator="fixed")
    sp.start()
    w = WatchProc("--url", sp.url, "--window", "2", "--period", "0.5", "--once", "--out", str(tmp_path / "w"))
    try:
        assert sp.wait_healthy(60), sp.log_text()[-2000:]
        core = sp.engine_core_pid()
        assert core is not None
        with SteadyLoad(sp.url, served_model(sp.url), streams=1, max_tokens=64):
            w.start()
            assert w.wait_event("start", 30) is not None, w.diag()
            bystander.make()
            os.kill(core, signal.SIGSTOP)
            assert w.popen is not None
            assert w.popen.wait(timeout=120) == 10, w.diag()
        bystander.make()
        bystander.assert_untouched()
    finally:
        if w.popen is not None and w.popen.poll() is None:
            w.popen.kill()
            w.popen.wait()
        if core := sp.engine_core_pid(0.1):
            os.kill(core, signal.SIGCONT)
        sp.stop()
        remove_device_files(dev)
