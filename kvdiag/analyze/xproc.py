"""One wait-for graph over every captured thread of every captured process, and the chain to its root.

Pure: reads the bundle only. Each thread's waits become typed edges (kvdiag.model.waits.WaitEdge) with the
evidence that proves them: a read on a socket or pipe leads to the peer (a pipe's writers), a write
blocked on a full pipe or socket to its readers, wait4/waitpid to the child, a futex in a MAP_SHARED
file mapping to every other process mapping that file, a ZMQ call (the thread parks on the socket's
signaler fd) to the peers of the process's ZMQ I/O thread's connections, a spinning reader of a shared
ring whose bytes did not move to the ring's other mappers. Each edge also says what the wait is for:
``work`` (a server or worker waiting for its next request: idle, not stuck), ``reply`` (a client waiting
for an answer), ``blocked`` (data that cannot be delivered) or ``depends`` (it is as stuck as whoever
it waits on: a parent on its child, a rank at a barrier, a ring reader).

From every waiter the chain is followed process by process to its root: a process whose own stacks
show a hang, a thread blocked on a lock or condition only its own (blocked) threads could release, a
process parked waiting for work, one that runs or whose ring advances, or a cycle. Which chain
makes the verdict is kvdiag.analyze.xverdict's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvdiag.analyze import vocab as v
from kvdiag.analyze.access import judgeable
from kvdiag.analyze.classify import ThreadView, WaitKind, classify_process
from kvdiag.analyze.outcome import observed, process_waits
from kvdiag.analyze.process import analyze_process
from kvdiag.analyze.rulekit import peer_phrase
from kvdiag.analyze.tcp_match import TcpIndex, TcpMatch, split_connection
from kvdiag.analyze.vllm_titles import process_title
from kvdiag.analyze.vllm_waits import shared_progress, vllm_wait
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import FdInfo, ProcessEvidence
from kvdiag.model.kinds import EnginePhase, VerdictKind
from kvdiag.model.verdict import Verdict, WaitPurpose
from kvdiag.model.waits import (
    EdgeEvidence,
    EdgeKind,
    FrameRef,
    NodeRef,
    SharedMapping,
    WaitEdge,
    WaitGraphRecord,
    WaitNode,
)

_ZMQ_SEND = ("zmq_msg_send", "zmq_send", "zmq_sendmsg", "zmq_sendiov")
_ZMQ_RECV = ("zmq_msg_recv", "zmq_recv", "zmq_recvmsg", "zmq_recviov")
_ZMQ_IO_THREAD = "ZMQbg/IO"
_MAX_CHAIN = 16
_BLOCKING = frozenset({WaitKind.COND_WAIT, WaitKind.MUTEX_WAIT, WaitKind.PY_LOCK_WAIT, WaitKind.FUTEX_WAIT})


def _native(view: ThreadView) -> bool:
    return any(f.kind == "native" for f in view.frames)


def _zmq_python_calls(view: ThreadView) -> set[str]:
    """pyzmq's own Python frames (zmq/sugar): a send or a receive, worded as libzmq's calls."""
    out: set[str] = set()
    for f in view.frames[:8]:
        if f.kind == "python" and "/zmq/" in (f.file or ""):
            name = f.name.rsplit(".", 1)[-1]
            out |= {"zmq_msg_send"} if name.startswith("send") else {"zmq_msg_recv"} if name.startswith(
                "recv") else {"zmq_poll"} if name == "poll" else set()
    return out


# A process is (node, pid): pids are unique only within a host, and a merged bundle holds several.
PKey = tuple[str | None, int]


def pkey(ref: NodeRef | ProcessEvidence) -> PKey:
    return (ref.node, ref.pid)


@dataclass
class Dep:
    """One typed edge and what the waiter waits for (``work`` / ``reply`` / ``blocked`` / ``depends``)."""

    edge: WaitEdge
    purpose: str
    dsts: list[PKey] = field(default_factory=list)     # candidate processes (an inferred edge has several)


@dataclass
class Root:
    key: PKey
    state: str                    # "hung", "blocked", "parked", "running", "stopped", "not_captured"
    view: ThreadView | None = None
    verdict: Verdict | None = None


@dataclass
class Chain:
    deps: list[Dep]
    root: Root | None
    cycle: bool = False


# More edge sources (ray.get across nodes, a runtime's own queues): each gets the graph, a process and one of
# its classified threads and returns that thread's extra edges (CrossProcess.edge builds one).
EdgeSource = Callable[["CrossProcess", ProcessEvidence, ThreadView], list[Dep]]
EDGE_SOURCES: list[EdgeSource] = []


class CrossProcess:
    """The graph of one bundle: typed edges per thread, each process's own verdict, chains to roots."""

    def __init__(self, bundle: Bundle) -> None:
        self.bundle = bundle
        machine = bundle.host.machine
        self.machine = machine
        self.procs: dict[PKey, ProcessEvidence] = {pkey(p): p for p in bundle.processes if p.alive and p.threads}
        self.views = {k: classify_process(p, machine) for k, p in self.procs.items()}
        self._own: dict[PKey, Verdict | None] = {}
        self.deps: dict[tuple[PKey, int], list[Dep]] = {}
        self._stalled = {e.name for e in bundle.engines if e.phase is EnginePhase.STALLED}
        self._tcp: TcpIndex | None = None
        # Connections of a merged bundle matched (or not) to another host: (waiter, tid, match).
        self.tcp_matches: list[tuple[PKey, int, TcpMatch]] = []
        for k, p in self.procs.items():
            for view in self.views[k]:
                found = self._edges(p, view) + [d for source in EDGE_SOURCES for d in source(self, p, view)]
                if found:
                    self.deps[(k, view.tid)] = found

    def thread_deps(self, k: PKey) -> list[Dep]:
        return [d for (q, _), ds in self.deps.items() if q == k for d in ds]

    # ------------------------------------------------------------ edges

    def ref(self, k: PKey, tid: int | None = None) -> NodeRef:
        return NodeRef(node=k[0], pid=k[1], tid=tid)

    def _frames(self, p: ProcessEvidence, view: ThreadView) -> list[FrameRef]:
        idx = [i for i, f in enumerate(view.frames[:12]) if f.name in _ZMQ_SEND + _ZMQ_RECV or v.matches(
            f.name, v.IO_READ) or v.matches(f.name, v.EVENT_WAIT) or f.kind == "python"][:3]
        return [FrameRef(pid=view.pid, tid=view.tid, index=i, node=p.node) for i in idx]

    def edge(self, p: ProcessEvidence, view: ThreadView, dsts: list[PKey], kind: EdgeKind, purpose: str,
             inferred: bool = False, fd: FdInfo | None = None, **ev: str | int | None) -> Dep | None:
        """A typed edge from ``view`` (a thread of ``p``) to the first of ``dsts`` (the others: alternatives)."""
        dsts = [q for q in dict.fromkeys(dsts) if q != pkey(p)]
        if not dsts:
            return None
        evidence = EdgeEvidence.model_validate({
            "frames": self._frames(p, view), "fd": fd.fd if fd else None, "inode": fd.inode if fd else None,
            "address": fd.address if fd else None, "text": peer_phrase(fd) if fd else "",
            **{k: val for k, val in ev.items() if val is not None}})
        edge = WaitEdge(src=self.ref(pkey(p), view.tid), dst=self.ref(dsts[0]), kind=kind, evidence=evidence,
                        inferred=inferred or len(dsts) > 1, purpose=purpose)
        return Dep(edge=edge, purpose=purpose, dsts=dsts)

    @staticmethod
    def _here(p: ProcessEvidence, pids: list[int]) -> list[PKey]:
        """Peers read from /proc live on the waiter's own host."""
        return [(p.node, q) for q in pids]

    def _edges(self, p: ProcessEvidence, view: ThreadView) -> list[Dep]:
        th = next(t for t in p.threads if t.tid == view.tid)
        if not view.stopped and (vllm := self._vllm(p, view)) is not None:
            return vllm   # vLLM's own protocol says what the thread waits on, and whether it moves
        if view.idle_by_design or view.stopped:
            return []
        ring = self._ring(p, view)     # a spinner naps and wakes by design: its ring says whether it waits
        if ring is not None:
            return [ring]
        if view.timed or view.woke:
            return []
        out: list[Dep | None] = []
        names = {f.name for f in view.frames[:16]} | _zmq_python_calls(view)
        zmq = bool(names & set(_ZMQ_SEND + _ZMQ_RECV)) or "zmq_poll" in names or self._zmq_by_proc(p, view)
        if zmq:
            out.append(self._zmq(p, view, names))
        elif view.kind in (WaitKind.IO_READ, WaitKind.EVENT_WAIT) and not view.running:
            for f in view.blocked_fds:
                if f.kind not in ("socket", "pipe", "mqueue") or f.listening:
                    continue
                if view.kind is WaitKind.EVENT_WAIT and not view.wait_forever:
                    continue
                if f.kind in ("pipe", "mqueue"):
                    peers = f.writer_pids if f.writer_pids is not None else f.peer_pids
                    kind = EdgeKind.PIPE_READ if f.kind == "pipe" else EdgeKind.MQUEUE_READ
                else:
                    peers = f.peer_pids or (f.listener_pids or [])
                    kind = EdgeKind.SOCKET_READ
                purpose = self._read_purpose(p, view, f)
                # a server's connection waiting for its next request needs no line when its client is elsewhere
                dsts, note = self._peers(p, view, f, peers, record=purpose != "work")
                out.append(self.edge(p, view, dsts, kind, purpose, fd=f, text=note))
        for f in th.write_fds:
            peers = (f.reader_pids if f.reader_pids is not None else f.peer_pids) if f.kind == "pipe" else (
                f.peer_pids or (f.listener_pids or []))
            kind = EdgeKind.PIPE_WRITE_FULL if f.kind == "pipe" else EdgeKind.SOCKET_WRITE_FULL
            dsts, note = self._peers(p, view, f, peers)
            out.append(self.edge(p, view, dsts, kind, "blocked", fd=f, syscall=th.syscall, text=note))
        if th.waited_pid is not None and not view.running:
            kids = [th.waited_pid] if th.waited_pid > 0 else list(p.children or [])
            out.append(self.edge(p, view, self._here(p, kids), EdgeKind.CHILD_WAIT, "depends", syscall=th.syscall))
        m = th.futex_mapping
        if m is not None and not view.running and view.kind in _BLOCKING:
            out.append(self.edge(p, view, self._mappers(p, [m]), EdgeKind.SHARED_FUTEX, "depends", inferred=True,
                                 mapping=m.line(), address=f"{th.futex_addr:#x}", inode=m.inode))
        return [d for d in out if d is not None]

    def _peers(self, p: ProcessEvidence, view: ThreadView, f: FdInfo, here: list[int],
               record: bool = True) -> tuple[list[PKey], str | None]:
        """The processes at the other end of ``f``: those capture named on ``p``'s own host; else, for a TCP
        connection in a bundle merged from several hosts, the process of another host holding the exact other
        end (kvdiag.analyze.tcp_match), with the line that says how it was matched (or why not)."""
        if here or f.kind != "socket" or not (f.proto or "").startswith("tcp") or p.node is None:
            return self._here(p, here), None
        ends = split_connection(f.address)
        if ends is None:
            return [], None
        if self._tcp is None:
            self._tcp = TcpIndex(self.bundle)
        match = self._tcp.other_end(pkey(p), *ends)
        if record:   # said only for a wait that could be stuck (not an idle server's, not every ZMQ connection)
            self.tcp_matches.append((pkey(p), view.tid, match))
        return ([e.key for e in match.peers] if match.resolved else []), match.note

    def _mappers(self, p: ProcessEvidence, maps: list[SharedMapping]) -> list[PKey]:
        """Every other captured process of the same host mapping one of the same files."""
        files = {(m.dev, m.inode) for m in maps}
        return [k for k, other in self.procs.items() if k != pkey(p) and other.node == p.node and any(
            (x.dev, x.inode) in files for x in other.shared_maps or [])]

    def _own_engine(self, p: ProcessEvidence, peers: list[int]) -> bool:
        """Every peer is another part (API server, EngineCore, worker) of ``p``'s own engine: its parts wait on
        each other by design (an output reader, an input loop), so the wait is as stuck as the peer, no more."""
        if p.role.value == "other" or not p.engine or not peers:
            return False
        parts = [self.procs.get((p.node, q)) for q in peers]
        return all(x is not None and x.engine == p.engine and x.role.value != "other" for x in parts)

    def _from_parent(self, p: ProcessEvidence, peers: list[int]) -> bool:
        """The channel is the parent's: it writes, and every other writer is one of its children (a pool's
        workers inherit the write end of the task queue with it): a worker waiting for its next order."""
        if p.ppid is None or p.ppid not in peers:
            return False
        return all(q in (p.ppid, p.pid) or (x := self.procs.get((p.node, q))) is not None and x.ppid == p.ppid
                   for q in peers)

    def _vllm(self, p: ProcessEvidence, view: ThreadView) -> list[Dep] | None:
        """The thread's wait in vLLM's protocol (kvdiag.analyze.vllm_waits); None when it is in none."""
        here = {q: x for (n, q), x in self.procs.items() if n == p.node}
        views = {q: self.views[(n, q)] for (n, q) in self.procs if n == p.node}
        vw = vllm_wait(p, view, here, self._stalled, views)
        if vw is None:
            return None
        if vw.moving:
            return []
        m = vw.mapping
        dep = self.edge(p, view, self._here(p, vw.peers), vw.kind, vw.purpose, inferred=vw.inferred, text=vw.text,
                        mapping=m.line() if m is not None else None, inode=m.inode if m is not None else None)
        return [dep] if dep is not None else []

    def _read_purpose(self, p: ProcessEvidence, view: ThreadView, f: FdInfo) -> str:
        peers = f.writer_pids if f.kind in ("pipe", "mqueue") and f.writer_pids is not None else f.peer_pids
        if self._own_engine(p, [q for q in peers if q != p.pid]):
            return "depends"
        if view.read_role == "request" or f.accepted or self._from_parent(p, peers):
            return "work"
        # A background thread's read while another thread of the process still acts is a receive loop (a
        # pool's result handler, an engine's output reader), as the process-level rules judge it.
        if not view.is_main and any(t.tid != view.tid and not t.idle_by_design and (
                t.running or t.woke or t.timed or t.kind in (WaitKind.SLEEP, WaitKind.EVENT_WAIT, WaitKind.UNKNOWN))
                for t in self.views[pkey(p)]):
            return "work"
        if view.read_role == "reply":
            return "reply"
        # A poll over several sources is a loop waiting for whatever comes, unless its frames say it waits
        # for an answer.
        if view.kind is WaitKind.EVENT_WAIT:
            return "work"
        return "reply"

    @staticmethod
    def _zmq_by_proc(p: ProcessEvidence, view: ThreadView) -> bool:
        """Without native frames, /proc shows a ZMQ wait: an untimed poll on nothing but eventfds (a ZMQ
        socket's signaler) in a process whose ZMQ I/O thread holds the connections."""
        fds = view.blocked_fds
        return not _native(view) and view.wait_forever and bool(fds) and all(
            f.kind == "anon" and "eventfd" in f.target for f in fds) and any(
            (t.name or "").startswith(_ZMQ_IO_THREAD) for t in p.threads)

    def _zmq(self, p: ProcessEvidence, view: ThreadView, names: set[str]) -> Dep | None:
        conns: list[FdInfo] = []
        dsts: list[PKey] = []
        for f in (f for t in p.threads if (t.name or "").startswith(_ZMQ_IO_THREAD) for f in t.blocked_fds
                  if f.kind == "socket" and not f.listening):
            # the I/O thread's connections: peers on this host, or over TCP, the other end on another host
            found, _ = self._peers(p, view, f, f.peer_pids or f.listener_pids or [], record=False)
            if found:
                conns.append(f)
                dsts += found
        peers = [q for n, q in dsts if n == p.node]
        if self._own_engine(p, [q for q in peers if q != p.pid]):
            purpose = "depends"
        elif names & set(_ZMQ_SEND):
            purpose = "blocked"
        elif (names & set(_ZMQ_RECV) or not _native(view)) and conns and not any(f.accepted for f in conns):
            purpose = "reply"        # it connected (a client) and waits for what it asked (or, frameless, to send)
        else:
            purpose = "work"         # it bound: a server waiting for its next request, or a poll loop
        sig = next((f for f in view.blocked_fds if f.kind == "anon"), None)
        return self.edge(p, view, dsts, EdgeKind.ZMQ, purpose, fd=conns[0] if conns else None,
                         syscall=f"signaler fd {sig.fd} ({sig.target})" if sig else None)

    def _ring(self, p: ProcessEvidence, view: ThreadView) -> Dep | None:
        """A Python thread napping or spinning in a loop while no /dev/shm ring (not a semaphore) of its
        process changed during the window: it waits on the rings' other mappers."""
        if view.kind not in (WaitKind.SLEEP, WaitKind.RUNNING) or not any(f.kind == "python" for f in view.frames):
            return None
        changed = p.progress.shared_changed if p.progress is not None else {}
        rings = [m for m in p.shared_maps or [] if m.path.startswith("/dev/shm/") and "/sem." not in m.path
                 and changed.get(f"{m.dev}:{m.inode}") is False]
        if not rings or any(changed.values()) or (p.progress is not None and p.progress.advanced):
            return None
        m = rings[0]
        return self.edge(p, view, self._mappers(p, rings), EdgeKind.SHM_RING, "depends", inferred=True,
                         mapping=m.line(), inode=m.inode,
                         text=f"no byte of the ring's head changed during the window ({m.path})")

    # ------------------------------------------------------------ roots

    def own_verdict(self, k: PKey) -> Verdict | None:
        if k not in self._own:
            p = self.procs[k]
            self._own[k] = analyze_process(p, self.machine, p.engine) if judgeable(
                [p], self.bundle.findings) else None
        return self._own[k]

    def _moving(self, k: PKey) -> bool:
        p = self.procs[k]
        shared = shared_progress(p)   # vLLM's segments: their flags, not whoever spins on them
        if shared is None:
            shared = p.progress is not None and any(p.progress.shared_changed.values())
        if shared or self._advanced(p):
            return True
        # The main thread in a sleep or a timed wait is doing something that ends by itself (a worker running
        # its job); a background thread's nap is more often a heartbeat than the work a waiter waits for.
        return any(((t.running or t.woke) or (t.is_main and (t.kind is WaitKind.SLEEP or t.timed)))
                   and not t.idle_by_design and (k, t.tid) not in self.deps for t in self.views[k])

    def _advanced(self, p: ProcessEvidence) -> bool:
        """I/O of its own, or growth of a log no other captured process writes: the processes of one engine
        share its log file (vLLM's API server logs every /health), whose growth does not say who wrote."""
        pr = p.progress
        if pr is None:
            return False
        if any(pr.io_delta.get(k, 0) > 0 for k in ("wchar", "syscw", "rchar", "syscr")):
            return True
        others = {f for k, x in self.procs.items() if k != pkey(p) and x.node == p.node for f in x.log_files}
        return any(grew > 0 and path not in others for path, grew in pr.log_growth.items())

    def root_of(self, k: PKey) -> Root:
        if k not in self.procs:
            return Root(key=k, state="not_captured")
        own = self.own_verdict(k)
        views = self.views[k]
        if own is not None and own.kind in (VerdictKind.STOPPED, VerdictKind.TRACED):
            return Root(key=k, state="stopped", verdict=own, view=self._view(k, own))
        if self._moving(k):
            return Root(key=k, state="running")
        if own is not None and own.kind.is_hang and own.kind is not VerdictKind.BLOCKED_IPC_READ:
            return Root(key=k, state="hung", verdict=own, view=self._view(k, own))
        live = [t for t in views if not t.idle_by_design]
        blocked = [t for t in live if t.kind in _BLOCKING and not t.timed and not t.shared_futex
                   and (k, t.tid) not in self.deps]
        # A thread that waits for the outside world (a read, a poll) may be the one to wake it, unless its
        # own wait is stuck on something (a reply, a full pipe).
        # A thread idle on new work (accept, a poll on its sockets, its next request) that did not advance over
        # the observed window wakes the blocked one only if new work arrives: it is not acting now.
        idle = {w.th.tid for w in process_waits(self.procs[k], self.machine) if w.purpose is WaitPurpose.NEW_WORK
                and w.advanced is False and w.view.kind in (WaitKind.EVENT_WAIT, WaitKind.IO_READ)} \
            if observed([self.procs[k]]) else set()
        others_act = [t for t in live if t not in blocked and t.tid not in idle and not any(
            d.purpose in ("reply", "blocked") for d in self.deps.get((k, t.tid), [])) and (
            t.running or t.woke or t.timed or t.kind in (WaitKind.SLEEP, WaitKind.UNKNOWN, WaitKind.EVENT_WAIT,
                                                          WaitKind.IO_READ))]
        if blocked and not others_act:
            return Root(key=k, state="blocked", view=sorted(blocked, key=lambda t: (not t.is_main, t.tid))[0])
        main = next((t for t in views if t.is_main), views[0] if views else None)
        return Root(key=k, state="parked", view=main)

    def _view(self, k: PKey, verdict: Verdict) -> ThreadView | None:
        tid = verdict.evidence[0].tid if verdict.evidence else None
        return next((t for t in self.views[k] if t.tid == tid), None)

    # ------------------------------------------------------------ chains

    def _next_dep(self, k: PKey, via: Dep | None) -> Dep | None:
        """The wait through which process ``k`` is stuck: its thread's non-work edge, if any."""
        cands = [d for d in self.thread_deps(k) if d.purpose != "work"]
        shared = via.edge.evidence.inode if via is not None and via.edge.kind is EdgeKind.SHARED_FUTEX else None
        # A thread waiting on the very futex we came through cannot post it.
        cands = [d for d in cands if not (shared is not None and d.edge.kind is EdgeKind.SHARED_FUTEX
                                          and d.edge.evidence.inode == shared)]
        order = {"blocked": 0, "reply": 1, "depends": 2}
        cands.sort(key=lambda d: (order.get(d.purpose, 3), d.edge.src.tid != k[1]))
        return cands[0] if cands else None

    def _pick(self, dep: Dep, on_chain: list[PKey]) -> PKey:
        """Of an edge's candidate processes, the one that explains the wait: not already on the chain, not
        waiting on the same shared futex, itself stuck on something else first."""
        def rank(q: PKey) -> int:
            if q in on_chain:
                return 9
            inode = dep.edge.evidence.inode
            if any(d.edge.kind is dep.edge.kind and d.edge.evidence.inode == inode for d in self.thread_deps(q)):
                return 8
            nxt = self._next_dep(q, dep)
            if nxt is not None:
                return 0 if nxt.purpose in ("blocked", "reply") else 1
            # A process outside the capture explains the wait only where no captured candidate can: a pipe's
            # write end is inherited by every child forked meanwhile (a short-lived job the capture never saw).
            return {"hung": 1, "blocked": 2, "stopped": 3, "parked": 5, "running": 6,
                    "not_captured": 7}.get(self.root_of(q).state, 4)
        return sorted(dep.dsts, key=rank)[0]

    def chain_from(self, start: Dep) -> Chain:
        deps = [start]
        keys = [pkey(start.edge.src)]
        while len(deps) < _MAX_CHAIN:
            dep = deps[-1]
            q = self._pick(dep, keys)
            dep.edge = dep.edge.model_copy(update={"dst": self.ref(q)})
            if q in keys:
                return Chain(deps=deps, root=None, cycle=True)
            keys.append(q)
            nxt = self._next_dep(q, dep)
            if nxt is None:
                return Chain(deps=deps, root=self.root_of(q))
            deps.append(Dep(edge=nxt.edge.model_copy(), purpose=nxt.purpose, dsts=list(nxt.dsts)))
        return Chain(deps=deps, root=None)

    def chains(self) -> list[Chain]:
        return [self.chain_from(Dep(edge=d.edge.model_copy(), purpose=d.purpose, dsts=list(d.dsts)))
                for ds in self.deps.values() for d in ds if d.purpose != "work"]

    def _inside(self) -> list[WaitEdge]:
        """Thread → thread edges inside each process, as the process-level rules read them: a mutex wait to
        the owner read from the mutex, a GIL wait to the holder."""
        out: list[WaitEdge] = []
        for k, p in self.procs.items():
            holder = next((t for t in self.views[k] if t.holds_gil), None)
            for th, view in zip(p.threads, self.views[k], strict=True):
                frames = [FrameRef(pid=p.pid, tid=th.tid, index=0, node=p.node)] if view.frames else []
                if th.futex_owner_tid is not None and th.futex_owner_tid != th.tid:
                    out.append(WaitEdge(src=self.ref(k, th.tid), dst=self.ref(k, th.futex_owner_tid),
                                        kind=EdgeKind.MUTEX_OWNER, purpose="depends", evidence=EdgeEvidence(
                                            frames=frames, address=f"{th.futex_addr:#x}" if th.futex_addr else None,
                                            syscall=th.syscall, text="owner TID read from the mutex")))
                if view.waits_gil and holder is not None and holder.tid != th.tid:
                    out.append(WaitEdge(src=self.ref(k, th.tid), dst=self.ref(k, holder.tid),
                                        kind=EdgeKind.GIL_HOLDER, purpose="depends", evidence=EdgeEvidence(
                                            frames=frames, text="; ".join(view.gil_wait_signals))))
        return out

    def record(self) -> WaitGraphRecord:
        edges = [d.edge for ds in self.deps.values() for d in ds] + self._inside()
        refs = {e.src.key(): e.src for e in edges} | {e.dst.key(): e.dst for e in edges}
        return WaitGraphRecord(nodes=[WaitNode(ref=r, label=self.label(pkey(r), r.tid)) for r in refs.values()],
                               edges=edges)

    # ------------------------------------------------------------ words

    def label(self, k: PKey, tid: int | None = None) -> str:
        node, pid = k
        p = self.procs.get(k) or next((x for x in self.bundle.processes if pkey(x) == k), None)
        what = ""
        if p is not None:
            # vLLM's own name says which rank (Worker_TP1)
            what = process_title(p) or (p.role.value if p.role.value != "other" else (p.comm or ""))
        head = f"pid {pid}" + (f" ({what})" if what else "") + (f" on {node}" if node else "")
        if tid is not None and tid != pid:
            view = next((t for t in self.views.get(k, []) if t.tid == tid), None)
            head += f" {view.label if view else f'thread {tid}'}"
        return head
