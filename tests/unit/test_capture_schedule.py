"""The capture's scheduling decisions, without a target: tool slots by urgency, gdb as pystack's fallback,
py-spy inside the /proc window when pystack reads the native frames."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvdiag.capture.base import BackendResult
from kvdiag.capture.job import ProcessJob
from kvdiag.capture.orchestrate import _minor, _raised, _window_pyspy, make_backends
from kvdiag.capture.slots import ToolSlots
from kvdiag.capture.tools import GdbBackend, PyspyBackend, PystackBackend
from kvdiag.model.evidence import Frame, ThreadEvidence, ToolRun


def test_a_free_slot_goes_to_the_most_urgent_waiter() -> None:
    slots = ToolSlots(1)
    assert slots.acquire((0, 0), timeout=1.0)
    order: list[tuple[int, int]] = []
    ready = threading.Barrier(4)

    def waiter(prio: tuple[int, int]) -> None:
        ready.wait(timeout=10)
        if slots.acquire(prio, timeout=20):
            order.append(prio)
            slots.release()

    threads = [threading.Thread(target=waiter, args=(p,)) for p in ((2, 1), (0, 1), (2, 0))]
    for t in threads:
        t.start()
    ready.wait(timeout=10)
    end = time.monotonic() + 10   # every waiter queued (bounded), then the held slot is freed
    while len(slots._waiting) < 3 and time.monotonic() < end:
        time.sleep(0.01)
    slots.release()
    for t in threads:
        t.join(timeout=20)
    # pystack (0) before gdb (2); a focus process (0) before the others (1)
    assert order == [(0, 1), (2, 0), (2, 1)]


def test_a_slot_wait_is_bounded() -> None:
    slots = ToolSlots(1)
    assert slots.acquire((0, 0), timeout=1.0)
    start = time.monotonic()
    assert not slots.acquire((0, 0), timeout=0.2)
    assert time.monotonic() - start < 5
    slots.release()
    assert slots.acquire((1, 1), timeout=1.0)   # a timed-out waiter leaves no ticket behind


def _job(tmp_path: Path, pystack: PystackBackend, result: BackendResult | None) -> ProcessJob:
    job = ProcessJob(1, [pystack, GdbBackend()], {}, tmp_path, 10.0, time.monotonic() + 10)
    if result is not None:
        job.results["pystack"] = result
    return job


def _pystack_result(ok: bool, native: bool) -> BackendResult:
    frames = [Frame(name="take_gil", kind="native")] if native else [Frame(name="run", kind="python")]
    return BackendResult(tool=ToolRun(tool="pystack", ok=ok), threads=[ThreadEvidence(tid=1, frames=frames)])


def test_gdb_runs_only_where_pystack_read_no_native_frames(tmp_path: Path) -> None:
    covered = _job(tmp_path, PystackBackend(native=True), _pystack_result(True, True))._native_covered()
    assert covered is not None and covered.startswith("gdb skipped: pystack read the native frames")
    for job in (_job(tmp_path, PystackBackend(native=True), None),                               # not run
                _job(tmp_path, PystackBackend(native=True), _pystack_result(False, True)),       # failed
                _job(tmp_path, PystackBackend(native=True), _pystack_result(True, False)),       # no native
                _job(tmp_path, PystackBackend(native=False), _pystack_result(True, True))):      # Python only
        assert job._native_covered() is None


def test_pyspy_pauses_the_target_only_where_pystack_cannot_read_native_frames() -> None:
    chosen = make_backends()
    spy = next(b for b in _window_pyspy(chosen, {}, None) if isinstance(b, PyspyBackend))
    assert not spy.native and not spy.stops_target        # inside the /proc window
    spy = next(b for b in _window_pyspy(chosen, {"pystack": "pystack not installed"}, None)
               if isinstance(b, PyspyBackend))
    assert spy.native and spy.stops_target                # the chain's native frames then
    minor = _minor(chosen)
    assert not any(isinstance(b, PyspyBackend) and b.stops_target for b in minor)
    assert any(isinstance(b, PystackBackend) and b.native for b in minor)
    # ptrace tools ask for a higher priority (granted where permitted: they pause the target), on copies
    raised = _raised(_window_pyspy(chosen, {}, None))
    assert all(getattr(b, "nice", 0) < 0 for b in raised if b.stops_target)
    assert all(getattr(b, "nice", 0) == 0 for b in chosen)


def test_other_processes_wait_for_the_focus_processes_first_tool() -> None:
    slots = ToolSlots(2)
    slots.add_focus()
    assert slots.acquire((0, 0), timeout=1.0)              # the EngineCore's pystack
    assert not slots.acquire((0, 1), timeout=0.2)          # a free slot, but the focus is not done
    slots.focus_done()
    assert slots.acquire((0, 1), timeout=1.0)
