"""Hangs no shape-specific rule was written for (tests/fixtures/hangers/families.py, each from a public report)
are named as hangs with their root and the chain in words, and their healthy look-alikes stay healthy.

Each program really hangs (or really idles) and is captured read-only with /proc and py-spy, as the hanger
corpus is; what a correct verdict says comes from how the program was written (hanger_kit.KINDS: ``expect``
and ``says``), never from the analyzer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvdiag.analyze.diagnosis import diagnose, exit_code_for
from kvdiag.capture.bundle import capture_tree
from kvdiag.model.verdict import WaitPurpose

HANGERS = Path(__file__).resolve().parents[1] / "fixtures" / "hangers"
sys.path.insert(0, str(HANGERS))
import hanger_kit as hk  # noqa: E402

pytestmark = pytest.mark.timeout(120)

FAMILIES = [k for k, spec in hk.KINDS.items() if spec.script == "families.py"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_is_named_with_its_chain(kind: str, tmp_path: Path) -> None:
    spec = hk.KINDS[kind]
    with hk.running(kind, bound_s=60) as h:
        tools = ["proc", "py-spy", "pystack"] if spec.native else ["proc", "py-spy"]
        bundle = capture_tree(h.root_pid, tmp_path / "bundle", timeout_s=10.0, backends=tools)
    diag = diagnose(bundle)
    verdict = diag.verdict
    assert verdict.kind.value == spec.expect, f"{kind} ({spec.shape}): {verdict.summary}"
    assert exit_code_for(verdict) == (10 if spec.hangs else 0)
    for words in spec.says:
        assert words in verdict.summary, f"{kind}: {words!r} not in {verdict.summary!r}"
    waits = diag.thread_waits or []
    assert {w.pid for w in waits} >= {h.pid}, "every captured thread's wait is judged"
    if spec.hangs:
        assert verdict.evidence and verdict.evidence[0].frames, "a hang verdict cites a thread and its frames"
        # The inversion and the spinner's writer (a queue.get, a task queue by its frames) are named by the
        # shape rules; every other family rests on the stuck outcome-wait.
        if kind not in ("family_tcp_lock_inversion", "family_shm_spin"):
            assert any(w.stuck for w in waits), "the outcome-wait that stopped advancing is shown as stuck"
    else:
        assert not any(w.stuck for w in waits), [w for w in waits if w.stuck]
        # Health is earned, and the verdict says from what: progress the window saw, or every thread idle on
        # new work. Which of the two depends on where the sample caught the threads (both ends of the exchange
        # may be in recv), so either is accepted; a verdict resting on the stacks alone is not.
        assert "progress observed" in verdict.summary or "wait for new work" in verdict.summary, verdict.summary
        if "progress observed" not in verdict.summary:
            assert all(w.purpose in (WaitPurpose.NEW_WORK, WaitPurpose.RUNNING) for w in waits), waits
