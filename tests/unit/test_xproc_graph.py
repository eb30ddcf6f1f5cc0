"""The cross-process wait graph on hand-built evidence: edges typed from OS readings, chains to the root,
processes keyed by (node, pid), and the OS-reading decoders it rests on."""

from __future__ import annotations

from kvdiag.analyze.overall import analyze
from kvdiag.analyze.xproc import CrossProcess
from kvdiag.analyze.xverdict import judge_across
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import FdInfo, Frame, ProcessEvidence, ProgressSample, TargetAccess, ThreadEvidence
from kvdiag.model.kinds import ProcessRole, ThreadState, VerdictKind
from kvdiag.model.waits import EdgeKind, SharedMapping
from kvdiag.osread.maps import parse_maps_line
from kvdiag.osread.waitargs import blocked_call


def _reader(pid: int, peer: int, node: str | None = None) -> ProcessEvidence:
    """A client whose main thread waits, untimed, for a reply on a Unix socket from ``peer``."""
    th = ThreadEvidence(tid=pid, name="MainThread", state=ThreadState.SLEEPING, cpu_ticks_delta=0,
                        ctx_switches_delta=0, syscall="45 0x3 0x7f 0x40 0x0 0x0 0x0", syscall_nr=45,
                        wchan="unix_stream_read_generic",
                        frames=[Frame(name="recv", library="libc.so.6"),
                                Frame(name="call_engine", kind="python", file="/srv/client.py", line=12)],
                        blocked_fds=[FdInfo(fd=3, kind="socket", proto="unix", inode=11, peer_inode=12,
                                            peer_pids=[peer])])
    return ProcessEvidence(pid=pid, node=node, comm="client", threads=[th], progress=ProgressSample(window_s=0.4))


def _server(pid: int, node: str | None = None) -> ProcessEvidence:
    """A server parked in accept(): waiting for work."""
    th = ThreadEvidence(tid=pid, name="MainThread", state=ThreadState.SLEEPING, cpu_ticks_delta=0,
                        ctx_switches_delta=0, syscall="43 0x4 0x0 0x0 0x0 0x0 0x0", syscall_nr=43,
                        wchan="inet_csk_accept",
                        frames=[Frame(name="accept", library="libc.so.6"),
                                Frame(name="serve", kind="python", file="/srv/server.py", line=30)])
    return ProcessEvidence(pid=pid, node=node, comm="server", threads=[th], progress=ProgressSample(window_s=0.4))


def test_a_reply_nobody_produces_is_a_lost_message_named_at_the_parked_server() -> None:
    bundle = Bundle(processes=[_reader(10, 20), _server(20)])
    cross, graph = judge_across(bundle)
    assert cross is not None and cross.kind is VerdictKind.BLOCKED_IPC_READ
    assert cross.waits is not None and cross.waits.lost_message and cross.waits.root is not None
    assert cross.waits.root.pid == 20 and cross.waits.edges[0].kind is EdgeKind.SOCKET_READ
    assert cross.waits.root_frames and "message was lost" in cross.summary
    assert [e.kind for e in graph.edges] == [EdgeKind.SOCKET_READ]
    assert analyze(bundle).waits is not None


def test_processes_are_keyed_by_node_and_pid() -> None:
    """Two hosts, the same pids: host a's client waits on host a's server only."""
    bundle = Bundle(processes=[_reader(10, 20, "a"), _server(20, "a"), _server(10, "b"), _reader(20, 10, "b")])
    g = CrossProcess(bundle)
    assert set(g.procs) == {("a", 10), ("a", 20), ("b", 10), ("b", 20)}
    dsts = {(d.edge.src.node, d.edge.src.pid): (d.edge.dst.node, d.edge.dst.pid)
            for ds in g.deps.values() for d in ds}
    assert dsts == {("a", 10): ("a", 20), ("b", 20): ("b", 10)}


def test_a_server_waiting_for_work_starts_no_chain() -> None:
    server = _server(20)
    assert judge_across(Bundle(processes=[server]))[0] is None


def test_os_reading_decoders() -> None:
    m = parse_maps_line("7f1c2d000000-7f1c2d001000 rw-s 00000000 00:1b 1558    /dev/shm/sem.z4uPq8 (deleted)\n")
    assert m is not None and m.inode == 1558 and m.contains(0x7F1C2D000010) and m.path.endswith("(deleted)")
    assert parse_maps_line("7f1c2d000000-7f1c2d001000 rw-p 00000000 00:00 0\n") is None
    assert blocked_call("61 0x518b 0x7ffd 0x0 0x0 0x0 0x0", "x86_64") == blocked_call("61 0x518b", "x86_64")
    call = blocked_call("61 0x518b 0x7ffd 0x0 0x0 0x0 0x0", "x86_64")
    assert call is not None and call.op == "wait" and call.pid == 0x518B
    assert blocked_call("61 0xffffffffffffffff 0x0 0x0 0x0 0x0 0x0", "x86_64").pid == -1  # type: ignore[union-attr]
    w = blocked_call("1 0x1 0x7efd 0x400000 0x0 0x0 0x0", "x86_64")
    assert w is not None and w.op == "write" and w.fd == 1
    assert blocked_call("0 0x3 0x0 0x0", "x86_64") is None


def _spinner(pid: int, role: ProcessRole, ring: SharedMapping, cpu: int = 6) -> ProcessEvidence:
    """A process whose main thread spins on a shared-memory ring (vLLM's shm_broadcast acquire_read)."""
    th = ThreadEvidence(tid=pid, name="MainThread", state=ThreadState.RUNNING, cpu_ticks_delta=cpu,
                        ctx_switches_delta=40, frames=[
                            Frame(name="sched_yield", library="libc.so.6"),
                            Frame(name="acquire_read", kind="python", file="/v/distributed/shm_broadcast.py"),
                            Frame(name="dequeue", kind="python", file="/v/distributed/shm_broadcast.py")])
    return ProcessEvidence(pid=pid, comm=role.value, role=role, engine="e", threads=[th], shared_maps=[ring],
                           progress=ProgressSample(window_s=0.4, shared_changed={f"{ring.dev}:{ring.inode}": False}))


def test_a_ring_whose_other_rank_is_stopped_names_that_rank_at_the_end_of_the_chain() -> None:
    """EngineCore and TP0 spin on the broadcast ring; TP1 was SIGSTOPped: nothing advances the ring."""
    ring = SharedMapping(start=0x7F0000000000, end=0x7F0000100000, perms="rw-s", dev="00:1b", inode=77,
                         path="/dev/shm/psm_1234")
    core = _spinner(20, ProcessRole.ENGINE_CORE, ring)
    tp0 = _spinner(30, ProcessRole.WORKER, ring)
    tp1 = _spinner(31, ProcessRole.WORKER, ring, cpu=0)
    tp1.state = ThreadState.STOPPED
    tp1.threads[0].state = ThreadState.STOPPED
    tp1.access = TargetAccess(state="T")
    cross, _ = judge_across(Bundle(processes=[core, tp0, tp1]))
    assert cross is not None and cross.kind is VerdictKind.STOPPED, cross and cross.summary
    assert cross.waits is not None and cross.waits.root is not None and cross.waits.root.pid == 31
    assert {e.kind for e in cross.waits.edges} == {EdgeKind.SHM_RING}


def test_an_idle_ring_is_not_a_hang() -> None:
    """The same ring with every rank spinning and nothing stopped: idle, not stuck."""
    ring = SharedMapping(start=0x7F0000000000, end=0x7F0000100000, perms="rw-s", dev="00:1b", inode=77,
                         path="/dev/shm/psm_1234")
    procs = [_spinner(20, ProcessRole.ENGINE_CORE, ring), _spinner(30, ProcessRole.WORKER, ring),
             _spinner(31, ProcessRole.WORKER, ring)]
    assert judge_across(Bundle(processes=procs))[0] is None
