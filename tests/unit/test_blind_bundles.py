"""The analyzer on bundles captured from three programs of the blind corpus (tests/fixtures/blind), saved after
it was scored: a dead thread's traceback in a live process's log, a spinner on shared memory whose writer is
stuck, and a wait cycle through a file lock and waitpid. Real captures, no tool mocked."""

from __future__ import annotations

from pathlib import Path

from kvdiag.analyze.overall import analyze
from kvdiag.bundle.io import load_bundle
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import VerdictKind

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "blind"


def load(name: str) -> Bundle:
    bundle, _ = load_bundle(BUNDLES / name)
    return bundle


def test_a_crash_line_in_a_live_process_log_is_a_finding_beside_the_stuck_lock_wait() -> None:
    v = analyze(load("rlock_dead_owner"))
    assert v.kind in (VerdictKind.UNKNOWN, VerdictKind.LOST_WAKEUP), v.summary
    assert "died with an exception" in v.summary
    assert any(f.kind == "log_line" for f in v.findings)
    assert v.evidence and v.evidence[0].tid == v.evidence[0].pid    # the main thread's lock wait is cited


def test_a_spinner_on_unchanged_shared_memory_does_not_count_as_the_one_who_posts() -> None:
    v = analyze(load("shm_spin_flag"))
    assert v.kind in (VerdictKind.UNKNOWN, VerdictKind.LOST_WAKEUP), v.summary
    assert "spins on the shared mapping" in v.summary


def test_a_cycle_through_flock_and_waitpid_is_not_a_blocked_read() -> None:
    v = analyze(load("waitpid_flock_cycle"))
    assert v.kind in (VerdictKind.UNKNOWN, VerdictKind.LOCK_ORDER_INVERSION), v.summary
    assert "flock()" in v.summary and "a cycle" in v.summary
