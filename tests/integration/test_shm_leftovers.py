"""The modelled device's shared files (/dev/shm/kvdiag-dev-*.acct, kvdiag-vmm-*.lock) never outlive
the engines that used them: not after SIGKILL of kvdiag (its reaper removes them), not after SIGTERM
of `kvdiag sim serve` (the API server removes them once its EngineCore is gone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from procs import reaper_run_id, wait_for

from kvdiag.allocator import native_module, remove_device_files
from kvdiag.sim.harness import SimProcess

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def device_files(name: str) -> list[str]:
    native = native_module()
    return [p for p in (native.device_account_path(name), native.device_lock_path(name)) if os.path.exists(p)]




def test_sigkill_of_kvdiag_leaves_no_device_files(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvdiag", "repro", "two-engine", "--out", str(tmp_path / "out")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run_id: str | None = None
    try:
        assert wait_for(lambda: reaper_run_id(proc.pid), 60), "kvdiag never started its reaper"
        run_id = reaper_run_id(proc.pid)
        assert run_id
        device = f"kvdiag-{run_id}"
        # Engine 1 has mapped KV pages on the run's device: both files exist.
        assert wait_for(lambda: len(device_files(device)) == 2, 150), "the run's device files never appeared"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert wait_for(lambda: not device_files(device), 30), f"left behind: {device_files(device)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if run_id:
            remove_device_files(f"kvdiag-{run_id}")


def test_sigterm_of_sim_serve_leaves_no_device_files(tmp_path: Path) -> None:
    device = f"kvdt{uuid.uuid4().hex[:10]}"
    sp = SimProcess(tmp_path / "sim.log", argv=None, allocator="fixed", layers=4, kv_per_layer_mb=64,
                    model="sim/test", device_name=device)
    sp.argv = [sys.executable, "-m", "kvdiag", "sim", "serve", *sp.argv[sp.argv.index("serve") + 1:]]
    try:
        sp.start()
        assert sp.wait_healthy(120), sp.log_text()
        assert len(device_files(device)) == 2
        sp.signal(signal.SIGTERM)
        assert sp.wait_exit(30) == 0, sp.log_text()
        assert device_files(device) == [], sp.log_text()[-2000:]
    finally:
        sp.stop()
        remove_device_files(device)
