"""The cross-process wait model round-trips through JSON, and bundles written before it still load."""

from __future__ import annotations

from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import VerdictKind
from kvdiag.model.verdict import Diagnosis, Verdict
from kvdiag.model.waits import (
    EdgeEvidence,
    EdgeKind,
    FrameRef,
    NodeRef,
    SharedMapping,
    WaitChain,
    WaitEdge,
    WaitGraphRecord,
    WaitNode,
)


def _chain() -> WaitChain:
    a, b = NodeRef(pid=10, tid=10, node="h1"), NodeRef(pid=20, tid=21)
    zmq = WaitEdge(src=a, dst=b.process(), kind=EdgeKind.ZMQ, evidence=EdgeEvidence(
        frames=[FrameRef(pid=10, tid=10, index=3, node="h1")], fd=7, inode=99, address="ipc:///tmp/x"))
    fut = WaitEdge(src=NodeRef(pid=20), dst=b, kind=EdgeKind.SHARED_FUTEX, inferred=True, evidence=EdgeEvidence(
        mapping=SharedMapping(start=0x1000, end=0x2000, perms="rw-s", inode=5, path="/dev/shm/sem.x").line()))
    return WaitChain(edges=[zmq, fut], root=b, root_state="blocked", labels={a.key(): "client"})


def test_chain_and_graph_round_trip_through_json() -> None:
    chain = _chain()
    v = Verdict(kind=VerdictKind.BLOCKED_IPC_READ, summary="x", waits=chain)
    d = Diagnosis(verdict=v, wait_graph=WaitGraphRecord(nodes=[WaitNode(ref=chain.edges[0].src, label="client")],
                                                       edges=chain.edges))
    again = Diagnosis.model_validate_json(d.model_dump_json())
    assert again == d
    assert again.verdict.waits is not None and again.verdict.waits.nodes()[-1] == NodeRef(pid=20, tid=21)
    assert chain.edges[0].src.key() == "h1/P10:T10" and NodeRef(pid=3).key() == "P3"


def test_old_bundle_without_wait_fields_loads() -> None:
    raw = {"processes": [{"pid": 1, "threads": [{"tid": 1, "blocked_fds": [{"fd": 3}]}]}],
           "diagnosis": {"verdict": {"kind": "healthy", "summary": "ok"}}}
    b = Bundle.model_validate(raw)
    assert b.diagnosis is not None and b.diagnosis.verdict.waits is None and b.diagnosis.wait_graph is None
    p = b.processes[0]
    assert p.shared_maps is None and p.children is None and p.threads[0].waited_pid is None
    assert p.threads[0].blocked_fds[0].reader_pids is None
