"""A bare process still starting is judged from its log too: `loading shard 17/40` every 1.5 s is a slow start.

The program (hangers/slow_start.py --how shards) prints no vLLM wording and sleeps between lines, so the
capture's 0.4 s window mostly sees no log growth and its stacks show a thread asleep: before, kvdiag
called it healthy. Its phase (loading) and how recently the log was written come from the log file on
its stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvdiag.analyze.overall import analyze
from kvdiag.capture.bundle import capture_tree
from kvdiag.model.kinds import Confidence, VerdictKind

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "hangers"))
import hanger_kit as hk  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_a_loader_printing_shards_is_a_slow_start(tmp_path: Path) -> None:
    with hk.running("slow_start_shards", bound_s=60) as h:
        bundle = capture_tree(h.root_pid, tmp_path / "bundle", timeout_s=10.0, backends=["proc", "py-spy"])
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.SLOW_START, verdict.summary
    assert "phase loading" in verdict.summary and "loading shard" in verdict.summary, verdict.summary
    assert "still advancing" in verdict.summary and verdict.confidence is Confidence.MEDIUM, verdict.summary
