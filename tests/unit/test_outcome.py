"""Health is earned (kvdiag.analyze.outcome) on saved captures of the families (tests/fixtures/hangers/families.py),
and the /proc/locks reader.

The bundles in tests/fixtures/bundles/families are real captures (/proc, py-spy, pystack, gdb) saved by
``benchmarks/accuracy.py --keep-bundles``; what each must be called comes from how its program was written
(hanger_kit.KINDS), not from the analyzer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvdiag.analyze.diagnosis import diagnose
from kvdiag.analyze.outcome import stuck_outcome
from kvdiag.analyze.overall import analyze
from kvdiag.bundle.io import load_bundle
from kvdiag.model.bundle import Bundle
from kvdiag.model.verdict import WaitPurpose
from kvdiag.osread.locks import parse_locks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SAVED = FIXTURES / "bundles" / "families"
sys.path.insert(0, str(FIXTURES / "hangers"))
import hanger_kit as hk  # noqa: E402

NAMES = sorted(p.name for p in SAVED.iterdir() if (p / "bundle.json").is_file()) if SAVED.is_dir() else []


def load(name: str) -> Bundle:
    return load_bundle(SAVED / name)[0]


def test_proc_locks_lines_name_holders_and_waiters() -> None:
    text = ("1: FLOCK  ADVISORY  WRITE 4242 fe:00:2146323 0 EOF\n"
            "1: -> FLOCK  ADVISORY  WRITE 4243 fe:00:2146323 0 EOF\n"
            "2: POSIX  ADVISORY  READ 77 08:01:99 0 100\n"
            "3: OFDLCK ADVISORY  WRITE -1 08:01:100 0 EOF\n"
            "garbage\n")
    locks = parse_locks(text)
    assert [(lk.kind, lk.pid, lk.waiting) for lk in locks] == [
        ("FLOCK", 4242, False), ("FLOCK", 4243, True), ("POSIX", 77, False), ("OFDLCK", None, False)]
    assert locks[0].same_file(0xFE, 0, 2146323) and not locks[2].same_file(0xFE, 0, 2146323)
    assert (locks[2].start, locks[2].end, locks[2].access) == ("0", "100", "READ")


def test_the_saved_families_cover_hangs_and_look_alikes() -> None:
    if not NAMES:
        pytest.skip("no saved family bundles")
    assert any(hk.KINDS[n].hangs for n in NAMES) and any(not hk.KINDS[n].hangs for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_saved_family_gets_its_verdict_and_its_chain(name: str) -> None:
    spec = hk.KINDS[name]
    bundle = load(name)
    diag = diagnose(bundle)
    assert diag.verdict.kind.value == spec.expect, diag.verdict.summary
    for words in spec.says:
        assert words in diag.verdict.summary, (words, diag.verdict.summary)
    waits = diag.thread_waits or []
    assert len(waits) == sum(len(p.threads) for p in bundle.processes if p.alive)
    if not spec.hangs:
        assert not any(w.stuck for w in waits)


@pytest.mark.parametrize("name", NAMES)
def test_without_the_observation_nothing_is_called_stuck(name: str) -> None:
    """A bundle from before threads were observed one by one: "not observed", never "no progress"."""
    bundle = load(name)
    for p in bundle.processes:
        for t in p.threads:
            t.observed = None
    assert stuck_outcome(bundle, bundle.processes, None) is None
    waits = diagnose(bundle).thread_waits or []
    assert all(w.advanced is None and not w.stuck for w in waits)


def test_a_stale_loading_line_does_not_outvote_a_stuck_reply() -> None:
    if "family_rpc_no_deadline" not in NAMES:
        pytest.skip("not saved")
    verdict = analyze(load("family_rpc_no_deadline"))
    assert verdict.kind.is_hang and "loading" not in verdict.kind.value
    assert any(e.pid != verdict.evidence[0].pid for e in verdict.evidence), "the handler in the server is cited"


def test_waits_for_new_work_are_told_apart_from_outcomes() -> None:
    if "family_pool_dead_worker" not in NAMES:
        pytest.skip("not saved")
    waits = diagnose(load("family_pool_dead_worker")).thread_waits or []
    stuck = [w for w in waits if w.stuck]
    assert len(stuck) == 1 and stuck[0].purpose is WaitPurpose.OUTCOME and "AsyncResult" in stuck[0].what
    assert sum(1 for w in waits if w.purpose is WaitPurpose.NEW_WORK) >= 3   # the pool's threads and workers


def test_a_timer_loop_back_in_the_same_sleep_is_not_somewhere_else() -> None:
    """clock_nanosleep takes four arguments: the last two of a /proc syscall line are whatever the registers held,
    and a heartbeat loop sleeping again in the same call must not read as having moved (it made a TCP server with
    a lock-order inversion look alive under load)."""
    from kvdiag.capture.procfs import _observation
    from kvdiag.osread.tasks import TaskReading

    a = TaskReading(tid=7, utime=10, stime=0, voluntary=5, nonvoluntary=0)
    b = TaskReading(tid=7, utime=10, stime=0, voluntary=6, nonvoluntary=0)
    first = "230 0x1 0x1 0x7ffd32261810 0x0 0x0 0x7f3a00000001 0x7ffd322617f0 0x7f3a1c0e2a3d"
    again = "230 0x1 0x1 0x7ffd32261810 0x0 0x55d0a0 0x7f3a00000bad 0x7ffd322617f0 0x7f3a1c0e2a3d"
    obs = _observation(a, b, first, again, None, None)
    assert obs is not None and obs.same_syscall is True and not obs.advanced
    other = "202 0x55b6c8ad0300 0x189 0x0 0x0 0x0 0xf 0x7ffd322617f0 0x7f3a1c0e2a3d"
    moved = _observation(a, b, first, other, None, None)
    assert moved is not None and moved.same_syscall is False and moved.advanced
