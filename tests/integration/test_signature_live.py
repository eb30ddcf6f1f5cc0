"""The same hang captured twice, in two processes with different pids, gives the same signature."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvdiag.analyze.overall import analyze
from kvdiag.capture.bundle import capture_tree
from kvdiag.model.kinds import VerdictKind

HANGERS = Path(__file__).resolve().parents[1] / "fixtures" / "hangers"
sys.path.insert(0, str(HANGERS))
import hanger_kit as hk  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_gil_cycle_captured_twice_signs_the_same_and_is_known(tmp_path: Path) -> None:
    results = []
    for run in range(2):
        with hk.running("gil_cycle", build_dir=tmp_path / "build", under_parent=True, title="VLLM::EngineCore",
                        bound_s=90) as h:
            bundle = capture_tree(h.root_pid, tmp_path / f"bundle{run}", timeout_s=20)
            verdict = analyze(bundle)
            results.append((h.pid, verdict, bundle))
    (pid1, v1, b1), (pid2, v2, b2) = results
    assert pid1 != pid2
    assert v1.kind is VerdictKind.GIL_CYCLE and v2.kind is VerdictKind.GIL_CYCLE
    assert v1.signature is not None and v1.signature.startswith("gil_cycle-")
    assert v1.signature == v2.signature
    # nothing run-specific went into it: the pids and tids differ between the runs
    assert str(pid1) not in v1.signature and str(pid2) not in v2.signature
    assert v1.known is not None and v1.known.id == "kvcached#371"
    assert v1.known.fixed_by and "#422" in v1.known.fixed_by and v1.known.fixed_in == "0.1.6"
    # every bundle carries the environment record
    assert b1.environment is not None and b1.environment.python
    assert b1.environment.env_source == f"pid {pid1}"   # the engine's own variables, not kvdiag's
    assert b2.environment is not None and b2.environment.kernel
