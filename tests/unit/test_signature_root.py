"""A hang's signature depends on the hang, not on how many of its waiters the capture reached."""

from __future__ import annotations

from pathlib import Path

from kvdiag.analyze import diagnose
from kvdiag.analyze.signature import hang_signature, project_frames
from kvdiag.bundle import load_bundle

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


def test_a_chain_signs_by_its_root_whatever_waiters_were_captured() -> None:
    bundle = load_bundle(BUNDLES / "xproc" / "xproc_zmq_req_rep")[0]
    verdict = diagnose(bundle).verdict
    assert verdict.waits is not None and verdict.waits.root is not None
    root = verdict.waits.root.pid
    waiters = [e for e in verdict.evidence if e.pid != root]
    assert waiters, "the chain cites a waiter in front of the root"
    # the waiter has project frames of its own: before, it changed the signature
    proc = next(p for p in bundle.processes if p.pid == waiters[0].pid)
    assert any(project_frames(t.frames) for t in proc.threads if t.tid == waiters[0].tid)
    only_root = verdict.model_copy(update={"evidence": [e for e in verdict.evidence if e.pid == root]})
    assert hang_signature(only_root, bundle) == hang_signature(verdict, bundle) == verdict.signature
