"""A hang across processes and nodes: its signature by its root, and every waiter shown blocked on it."""

from __future__ import annotations

from pathlib import Path

from kvdiag.analyze.diagnosis import diagnose
from kvdiag.analyze.signature import hang_signature, project_frames
from kvdiag.bundle.io import load_bundle

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


def test_a_ray_actor_blocked_on_a_hung_actor_is_not_healthy() -> None:
    """Merged across two Ray nodes: the caller actor parked in ray.get of the hung actor's task is shown
    blocked on that peer (it was listed healthy), and the overall verdict stays the root's."""
    bundle = load_bundle(BUNDLES / "ray_pyabba_two_nodes")[0]
    diag = diagnose(bundle)
    assert diag.verdict.kind.value == "lock_order_inversion"
    caller = [v for v in diag.verdicts_by_engine.values() if "Caller" in v.summary]
    assert caller and caller[0].kind.value == "blocked_ipc_read", [v.summary for v in diag.verdicts_by_engine.values()]
    assert "which is hung (lock_order_inversion)" in caller[0].summary


def test_a_place_never_ends_with_a_dangling_arrow() -> None:
    from kvdiag.analyze.xverdict import _place
    from kvdiag.model.verdict import EvidenceItem
    item = EvidenceItem(pid=1, tid=1, role="r", frames=["accept4 (libc.so.6)", " (x.py:3)"], key_frames=[0, 1])
    assert _place(item) == " in accept4"


def test_the_chain_does_not_repeat_the_roots_sentence() -> None:
    """A real vLLM engine in the GIL cycle: the summary says the cycle once, then who waits on it."""
    verdict = diagnose(load_bundle(BUNDLES / "vllm_two_engine_stock")[0]).verdict
    assert verdict.summary.count("GIL cycle in pid") == 1, verdict.summary
    assert "is gil_cycle (above)" in verdict.summary


def test_a_ray_get_on_the_same_node_is_not_said_to_cross_nodes() -> None:
    """The same two actors with both on one node (the hung one moved there): the wait is named a wait on a
    peer of its own node, never 'waits_across_nodes'."""
    bundle = load_bundle(BUNDLES / "ray_pyabba_two_nodes")[0]
    src = next(p.node for p in bundle.processes if p.pid == 24544)
    dst = next(p.node for p in bundle.processes if p.pid == 24464)
    for record in [*bundle.processes, *(bundle.fleet.actors if bundle.fleet else []),
                   *(bundle.fleet.tasks if bundle.fleet else [])]:
        if record.node == src:
            record.node = dst
    kinds = {f.kind for f in diagnose(bundle).verdict.findings}
    assert "waits_on_peer" in kinds and "waits_across_nodes" not in kinds, kinds
