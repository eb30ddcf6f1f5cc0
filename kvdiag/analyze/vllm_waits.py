"""vLLM's own waits across processes, recognised from stacks and judged by what advances, never by CPU time.

vLLM's processes talk through rings in /dev/shm (``shm_broadcast.MessageQueue``): the EngineCore writes each
step's RPC to a broadcast ring its workers read, and reads each worker's answer from that worker's response
ring. Readers spin (``sched_yield``) for a second after a read, then poll a ZMQ notify socket with a 5 s
timeout and look again, forever: an idle worker uses ~30 % of a core, and a waiting EngineCore wakes every
5 s. With tensor parallelism on the CPU the ranks also meet in vLLM's shared-memory all-reduce (``shm.cpp``,
segments ``/dev/shm/vllm_dist_*-cpushm_<rank>``) and spin there at 100 % until every rank arrived.

So a thread in one of these loops is never "running" nor "idle by design": it waits on the other side of
its ring or collective, and it progresses only when that ring's flags (read from the segment at both ends
of the capture window, :class:`kvdiag.model.rings.RingReading`) or the collective's segments change:

- the EngineCore in ``collective_rpc``'s ``get_response`` → the workers whose response ring has nothing
  unread for it (rank 0 first: the one that answers an ``execute_model``), a reply it waits for;
- a worker in ``worker_busy_loop`` → the EngineCore: it waits for its next RPC (work, not a hang);
- a worker in the all-reduce → the other ranks mapping the same ``cpushm`` segments: it is as stuck as they;
- the API server, while its engine's run saw a request in flight and unanswered → its EngineCore over ZMQ
  (the engine client's sockets, held by its ZMQ I/O thread).

Pure: reads the bundle only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvdiag.analyze.classify import ThreadView
from kvdiag.analyze.vllm_titles import process_title, worker_rank
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import ProcessRole
from kvdiag.model.rings import RingReading
from kvdiag.model.waits import EdgeKind, SharedMapping

_RING_FILE = "shm_broadcast"
_READ_FNS = ("acquire_read", "dequeue")
_WRITE_FNS = ("acquire_write", "enqueue")
# vLLM CPU's shared-memory collectives (csrc/cpu/shm.cpp) and their Python entry.
_COLLECTIVE_NATIVE = ("shm_allreduce", "shm_gather", "shm_all_gather", "shm_send_tensor_list",
                      "shm_recv_tensor_list", "wait_for_all", "wait_for_one", "shm_cc_loop")
_COLLECTIVE_PY = "_CPUSHMDistributed."
_CPUSHM = re.compile(r"/dev/shm/vllm_dist_[^ ]*cpushm")
_ZMQ_IO_THREAD = "ZMQbg/IO"


@dataclass
class VllmWait:
    """One thread's wait on another vLLM process."""

    kind: EdgeKind
    purpose: str                   # "work" / "reply" / "depends" / "blocked" (as kvdiag.analyze.xproc's edges)
    peers: list[int]               # candidate processes, best first
    moving: bool = False           # what it waits on advanced during the window: progress, not a wait
    mapping: SharedMapping | None = None
    text: str = ""
    inferred: bool = False
    rings: list[RingReading] = field(default_factory=list)


def _fn(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def ring_side(view: ThreadView) -> str | None:
    """"read" / "write" when the thread is inside a MessageQueue ring wait (innermost such frame decides)."""
    for f in view.frames[:48]:
        if f.kind != "python" or _RING_FILE not in (f.file or f.name):
            continue
        fn = _fn(f.name)
        if fn in _READ_FNS:
            return "read"
        if fn in _WRITE_FNS:
            return "write"
    return None


def in_collective(view: ThreadView) -> bool:
    """The thread is inside vLLM CPU's shared-memory collective (native frames or its Python entry)."""
    for f in view.frames[:64]:
        if f.kind == "python":
            if f.name.startswith(_COLLECTIVE_PY):
                return True
        elif any(n in f.name for n in _COLLECTIVE_NATIVE):
            return True
    return False


def _py_fns(view: ThreadView) -> set[str]:
    return {_fn(f.name) for f in view.frames if f.kind == "python"}


def _mappers(procs: Mapping[int, ProcessEvidence], me: int, dev: str, inode: int) -> list[int]:
    return [q for q, other in procs.items() if q != me and any(
        m.inode == inode and m.dev == dev for m in other.shared_maps or [])]


def _mapping(p: ProcessEvidence, ring: RingReading) -> SharedMapping | None:
    return next((m for m in p.shared_maps or [] if m.inode == ring.inode and m.dev == ring.dev), None)


def _by_rank(procs: Mapping[int, ProcessEvidence], pids: list[int]) -> list[int]:
    def key(q: int) -> tuple[int, int]:
        rank = worker_rank(procs[q]) if q in procs else None
        return (rank if rank is not None else 1 << 20, q)
    return sorted(dict.fromkeys(pids), key=key)


def _reader_wait(p: ProcessEvidence, view: ThreadView, procs: Mapping[int, ProcessEvidence]) -> VllmWait | None:
    fns = _py_fns(view)
    rings = list(p.shm_rings or [])
    if "worker_busy_loop" in fns:
        # The broadcast ring: the EngineCore writes, every worker reads. Waiting there is waiting for work.
        cores = [q for q, other in procs.items() if other.role is ProcessRole.ENGINE_CORE and q != p.pid]
        moving = any(r.advanced for r in rings)
        return VllmWait(kind=EdgeKind.SHM_RING, purpose="work", peers=cores, moving=moving, rings=rings,
                        text="a worker waits on the broadcast ring for the EngineCore's next RPC")
    if p.role is ProcessRole.ENGINE_CORE and fns & {"get_response", "collective_rpc"}:
        # Each worker answers on its own ring (one reader: the EngineCore); the EngineCore reads them in rank
        # order, so a ring with an answer still unread is not the one it waits on.
        waiting: list[tuple[RingReading, int]] = []
        for r in rings:
            if r.geometry.n_reader != 1:
                continue
            others = [q for q in _mappers(procs, p.pid, r.dev, r.inode) if procs[q].role is ProcessRole.WORKER]
            if len(others) == 1 and r.unread_by(0) == 0:
                waiting.append((r, others[0]))
        moving = any(r.advanced for r in rings)
        if not waiting:
            workers = [q for q, other in procs.items() if other.role is ProcessRole.WORKER
                       and p.pid in ([other.ppid] if other.ppid else [])]
            return VllmWait(kind=EdgeKind.SHM_RING, purpose="reply", peers=_by_rank(procs, workers), moving=moving,
                            inferred=True, rings=rings,
                            text="the EngineCore waits for its workers' answers on their shared-memory rings "
                                 "(rings not read: the workers are its children)")
        peers = _by_rank(procs, [q for _, q in waiting])
        first = next(r for r, q in waiting if q == peers[0])
        flags = " ".join("".join(map(str, slot)) for slot in first.after)
        return VllmWait(kind=EdgeKind.SHM_RING, purpose="reply", peers=peers, moving=moving,
                        mapping=_mapping(p, first), rings=[r for r, _ in waiting], inferred=len(peers) > 1,
                        text=f"the EngineCore waits in collective_rpc for the answer of {len(peers)} worker(s) "
                             f"on their response rings; nothing unread, no flag moved during the window "
                             f"({first.path}: slots [written,read] {flags})")
    return None


def _collective_wait(p: ProcessEvidence, procs: Mapping[int, ProcessEvidence],
                     views: Mapping[int, list[ThreadView]]) -> VllmWait | None:
    segs = [m for m in p.shared_maps or [] if _CPUSHM.search(m.path)]
    if not segs:
        return None
    peers: list[int] = []
    for m in segs:
        peers += _mappers(procs, p.pid, m.dev, m.inode)
    peers = _by_rank(procs, peers)
    # A waiting rank keeps writing its own stamp into its segment, so changing bytes are no progress: the
    # collective moves only while every rank of the group is inside it, and then its segments change.
    absent = [q for q in peers if not any(in_collective(t) for t in views.get(q, []))]
    changed = p.progress.shared_changed if p.progress is not None else {}
    moving = bool(peers) and not absent and any(changed.get(f"{m.dev}:{m.inode}") for m in segs)
    names = ", ".join(f"pid {q}" for q in absent)
    return VllmWait(kind=EdgeKind.OTHER, purpose="depends", peers=absent + [q for q in peers if q not in absent],
                    moving=moving, mapping=segs[0], inferred=len(absent) != 1,
                    text=f"spins in vLLM CPU's shared-memory all-reduce (shm.cpp) until every rank of its group "
                         f"arrives ({segs[0].path}); "
                         + (f"not in it: {names}" if absent else "every rank is in it"))


def _api_wait(p: ProcessEvidence, view: ThreadView, procs: Mapping[int, ProcessEvidence],
              stalled_engines: set[str]) -> VllmWait | None:
    if p.role is not ProcessRole.API_SERVER or not view.is_main:
        return None
    # vLLM's own EngineCores only (titled VLLM::EngineCore...): other engines' front ends talk otherwise.
    cores = [q for q, other in procs.items() if other.role is ProcessRole.ENGINE_CORE
             and (process_title(other) or "").startswith("EngineCore")
             and (other.engine == p.engine or other.ppid == p.pid)]
    if not cores:
        return None
    zmq_peers = {q for t in p.threads if (t.name or "").startswith(_ZMQ_IO_THREAD) for f in t.blocked_fds
                 if f.kind == "socket" for q in (f.peer_pids or [])}
    via = [q for q in cores if q in zmq_peers]
    if not via:
        return None   # no ZMQ connection to its EngineCore seen: not vLLM's engine client
    asked = p.engine is not None and p.engine in stalled_engines
    return VllmWait(kind=EdgeKind.ZMQ, purpose="reply" if asked else "work", peers=via,
                    text="the API server's engine client waits on ZMQ for its EngineCore's outputs"
                         + (" with a request in flight that was never answered" if asked else ""))


def shared_progress(p: ProcessEvidence) -> bool | None:
    """Whether the shared memory of a vLLM process moved during the window, read the vLLM way: its rings'
    flags, never the bytes of its all-reduce segments (a rank waiting there rewrites its own stamp) nor a
    ring's first chunk. None when the process maps none of vLLM's segments (judge it the generic way)."""
    rings = {(r.dev, r.inode) for r in p.shm_rings or []}
    ours = [m for m in p.shared_maps or [] if _CPUSHM.search(m.path) or (m.dev, m.inode) in rings]
    if not ours:
        return None
    if any(r.advanced for r in p.shm_rings or []):
        return True
    keys = {f"{m.dev}:{m.inode}" for m in ours}
    changed = p.progress.shared_changed if p.progress is not None else {}
    return any(moved for key, moved in changed.items() if key not in keys)


def vllm_wait(p: ProcessEvidence, view: ThreadView, procs: Mapping[int, ProcessEvidence],
              stalled_engines: set[str] | None = None,
              views: Mapping[int, list[ThreadView]] | None = None) -> VllmWait | None:
    """What vLLM's own protocol says this thread waits on, None when it is in none of vLLM's waits.

    ``stalled_engines``: engines whose run saw requests in flight and unanswered (the API server's ZMQ wait
    is then a reply, else it waits for work); ``views``: every captured process's threads (which ranks are
    inside a collective)."""
    side = ring_side(view)
    if side == "read":
        return _reader_wait(p, view, procs)
    if side == "write":
        rings = list(p.shm_rings or [])
        full = [r for r in rings if r.full()]
        if not full:
            return None
        r = full[0]
        return VllmWait(kind=EdgeKind.SHM_RING, purpose="blocked", moving=bool(r.advanced),
                        peers=_by_rank(procs, _mappers(procs, p.pid, r.dev, r.inode)), mapping=_mapping(p, r),
                        rings=full, inferred=True, text=f"waits to write a full ring ({r.path}): every slot unread")
    if in_collective(view):
        return _collective_wait(p, procs, views or {})
    return _api_wait(p, view, procs, stalled_engines or set())


__all__ = ["VllmWait", "in_collective", "ring_side", "shared_progress", "vllm_wait"]
