"""Co-located processes on one modelled host device: shared accounting and the cross-process
VMM lock (the fixed allocator's reserve backs off while another process holds it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from procs import kill_group

from kvdiag import _native as native  # built by the package: a missing build fails, never skips
from kvdiag.allocator import make_allocator

ROOT = Path(__file__).resolve().parents[2]
HOLDER = ROOT / "tests" / "fixtures" / "alloc_device_holder.py"
GIB = 1 << 30
PAGE = 64 * 1024


def _poll(pred: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


@contextmanager
def holder(device: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """Run the holder fixture in its own process group until it says READY; kill it on exit."""
    proc = subprocess.Popen([sys.executable, str(HOLDER), device, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded by the holder's own alarm
        assert line.startswith("HOLDER READY"), line
        yield proc
    finally:
        kill_group(proc, 30)


def test_usage_of_a_co_located_process_is_counted_while_it_lives() -> None:
    dev = f"kvdiag-it-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    a = make_allocator("fixed", num_layers=2, mem_size_per_layer=8 * PAGE, page_size=PAGE, device_name=dev,
                       device_size=4 * GIB, gpu_utilization=1.0, print_banner=False)
    per_page = 2 * 2 * PAGE
    assert a.get_avail_physical_pages() == 4 * GIB // per_page
    with holder(dev, "--register", str(3 * GIB)) as proc:
        assert native.device_used_bytes(dev) == 3 * GIB
        assert a.get_avail_physical_pages() == GIB // per_page
        proc.kill()
        proc.wait(timeout=30)
        # A dead process's slot stops counting at once (liveness is checked on every read).
        assert native.device_used_bytes(dev) == 0


def test_fixed_reserve_backs_off_while_another_process_holds_the_vmm_lock() -> None:
    dev = f"kvdiag-it-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    a = make_allocator("fixed", num_layers=2, mem_size_per_layer=8 * PAGE, page_size=PAGE, device_name=dev,
                       min_reserved_pages=4, max_reserved_pages=6, map_timeout_ms=300, backoff_ms=2,
                       print_banner=False)
    with holder(dev, "--hold-lock") as proc:
        a.start_prealloc_thread()
        assert _poll(lambda: a.counters()["backoffs"] > 0)
        assert a.get_num_reserved_pages() == 0 and a.get_num_inflight_pages() == 0
        with pytest.raises(native.AllocatorTimeout):
            a.alloc_page()  # the synchronous map waits for the device lock, bounded
        proc.kill()  # the kernel drops a dead holder's flock
        proc.wait(timeout=30)
        assert _poll(lambda: a.get_num_reserved_pages() == 4)
    assert a.alloc_page() == 0
    a.stop_prealloc_thread()
