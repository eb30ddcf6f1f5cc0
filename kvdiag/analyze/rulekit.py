"""Shared pieces of the process rules: how a thread and a process are named in a verdict, what a
thread's wait is called, which thread holds what, and who could still signal a waiter.
"""

from __future__ import annotations

import re

from kvdiag.analyze import vocab as v
from kvdiag.analyze.classify import ThreadView, WaitKind
from kvdiag.analyze.evidence import Key, cite_item
from kvdiag.analyze.vllm_titles import process_title
from kvdiag.analyze.waitgraph import WaitGraph
from kvdiag.model.evidence import FdInfo, ProcessEvidence
from kvdiag.model.kinds import ProcessRole, ThreadState, VerdictKind
from kvdiag.model.verdict import EvidenceItem

# Worst first (the overall verdict is the worst engine's); each kind's rank is part of its one definition
# (KIND_SPECS in kvdiag.model).
SEVERITY: tuple[VerdictKind, ...] = tuple(sorted(VerdictKind, key=lambda k: k.spec.rank))


TARGET_STATES = (VerdictKind.STOPPED, VerdictKind.TRACED)


HOLDER_BLOCKED = frozenset({WaitKind.COND_WAIT, WaitKind.MUTEX_WAIT, WaitKind.FUTEX_WAIT, WaitKind.IO_READ,
                             WaitKind.PY_LOCK_WAIT})


WAIT_WORDS = {
    WaitKind.COND_WAIT: "waiting on a condition variable", WaitKind.MUTEX_WAIT: "waiting for a mutex",
    WaitKind.FUTEX_WAIT: "blocked in a futex wait", WaitKind.IO_READ: "blocked reading a socket/pipe",
    WaitKind.IO_WRITE: "blocked writing into a full socket/pipe",
    WaitKind.PY_LOCK_WAIT: "blocked on a lock", WaitKind.GIL_WAIT: "waiting for the GIL",
}


PY_INTERNAL_LOCK_FRAMES = ("PyThread_acquire_lock_timed", "acquire_timed", "lock_PyThread_acquire_lock")


ROLE_TEXT = {ProcessRole.ENGINE_CORE: "the EngineCore", ProcessRole.API_SERVER: "the API server",
              ProcessRole.WORKER: "a Worker"}


def place(proc: ProcessEvidence) -> str:
    """``pid N`` plus which process of which engine it is, when known: the report says which process of a
    vLLM tree holds the hang (the EngineCore, not the API server the user launched)."""
    role = ROLE_TEXT.get(proc.role)
    at = f" on node {proc.node}" if proc.node else ""
    if role is None:
        return f"pid {proc.pid}{at}"
    if proc.role is ProcessRole.WORKER and (title := process_title(proc)) and title != "Worker":
        role = title   # which rank a tensor-parallel worker is (Worker_TP1), not just "a Worker"
    # A group kvdiag named after a pid ("pid-123", "node/pid-123") is no engine the user knows by that name.
    named = proc.engine is not None and _PID_GROUP.fullmatch(proc.engine) is None
    return f"pid {proc.pid}{at} ({role}{' of engine ' + str(proc.engine) if named else ''})"


_PID_GROUP = re.compile(r"(?:.*/)?pid-\d+")


def severity(kind: VerdictKind) -> int:
    return SEVERITY.index(kind)


def tnode(g: WaitGraph, t: ThreadView, doing: str = "") -> str:
    """Thread node; the first caller's ``doing`` becomes part of its label."""
    return g.node(f"T{t.pid}:{t.tid:08d}", f"{t.label}: {doing}" if doing else t.label)


def obj_label(t: ThreadView) -> str:
    word = {WaitKind.COND_WAIT: "condvar", WaitKind.MUTEX_WAIT: "mutex", WaitKind.IO_READ: "read",
            WaitKind.PY_LOCK_WAIT: "lock"}.get(t.kind, "futex")
    return f"{word} {t.wait_addr:#x}" if t.wait_addr else f"{word} of thread {t.tid}"


def onode(g: WaitGraph, t: ThreadView) -> str:
    key = f"{t.wait_addr:x}" if t.wait_addr else f"t{t.tid}"
    return g.node(f"OBJ{t.pid}:{key}", obj_label(t))


def has_frame(view: ThreadView, needle: str) -> bool:
    return any(needle in f.name for f in view.frames)


def holder_role(h: ThreadView) -> str:
    what = WAIT_WORDS.get(h.kind, "blocked")
    if has_frame(h, "alloc_page"):
        return f"alloc_page caller (holds the GIL, {what})"
    return f"GIL holder ({what})"


def waiter_role(w: ThreadView) -> str:
    if has_frame(w, "map_pages"):
        return "prealloc worker in map_pages (waits for the GIL)"
    if has_frame(w, "prealloc_worker"):
        return "prealloc worker (waits for the GIL)"
    return "waits for the GIL"


def cited(t: ThreadView, role: str, engine: str | None, keys: tuple[Key, ...]) -> EvidenceItem:
    """The thread's cited frames; ``keys`` says which of them this rule's conclusion rests on."""
    return cite_item(t, role, engine, keys)


def pick_holder(views: list[ThreadView]) -> ThreadView | None:
    holders = [t for t in views if t.holds_gil]
    if not holders:
        return None
    for src in ("pystack", "proc", "py-spy", "merged"):
        ranked = [t for t in holders if src in t.gil_holder_sources]
        if ranked:
            blocked = [t for t in ranked if not t.running]
            return (blocked or ranked)[0]
    return holders[0]


def infer_holder(views: list[ThreadView]) -> ThreadView | None:
    """Without an interpreter flag: the one blocked, non-idle thread that did not release the GIL."""
    if any(t.running and not t.idle_by_design for t in views):
        return None
    cands = [t for t in views if not t.waits_gil and not t.idle_by_design and not t.running
             and t.kind in (WaitKind.COND_WAIT, WaitKind.MUTEX_WAIT, WaitKind.FUTEX_WAIT, WaitKind.IO_READ)
             and not any(f.name in PY_INTERNAL_LOCK_FRAMES for f in t.frames)]
    return cands[0] if len(cands) == 1 else None


def released_gil(t: ThreadView) -> bool:
    """A Python-level lock wait has released the GIL; such a thread cannot be holding it."""
    return t.kind is WaitKind.PY_LOCK_WAIT and any(v.norm(f.name) in PY_INTERNAL_LOCK_FRAMES for f in t.frames)


def outside_peer(t: ThreadView, pid: int) -> bool:
    """The read can end without any thread of ``pid``: its peer is another process, none, or unknown."""
    conns = [f for f in t.blocked_fds if f.kind in ("socket", "pipe") and not f.listening]
    return not conns or all(f.peer_pids != [pid] for f in conns)


def peer_phrase(info: FdInfo) -> str:
    """``tcp socket 127.0.0.1:5 -> 127.0.0.1:6 (peer: pid 123 python3)``: one phrase for a report."""
    what = f"{info.proto} socket" if info.kind == "socket" and info.proto else (
        f"message queue {info.target.removesuffix(' (deleted)')}" if info.kind == "mqueue" else info.kind)
    if info.address and info.kind == "socket":
        what += f" {info.address}"
    if info.peer_pids:
        more = f" (+{len(info.peer_pids) - 1})" if len(info.peer_pids) > 1 else ""
        what += f" (peer: pid {info.peer_pids[0]}{f' {info.peer_comm}' if info.peer_comm else ''}{more})"
    elif info.listener_pids:   # a connection nobody accepted: whoever listens on that port has to
        more = f" (+{len(info.listener_pids) - 1})" if len(info.listener_pids) > 1 else ""
        what += f" (peer: not accepted, in the listen queue of pid {info.listener_pids[0]}{more})"
    elif info.kind == "socket" and info.proto in ("tcp", "tcp6", "udp"):
        what += " (peer: no process on this host; a remote peer)"
    elif info.kind == "socket" and info.proto == "unix" and info.peer_inode is None:
        what += " (peer not resolved)"   # sock_diag gave no peer inode: unknown, not absent
    elif info.kind in ("socket", "pipe"):
        what += " (no process holds the other end)"
    elif info.kind == "mqueue":
        what += " (no other process holds it: nobody else can send)"
    if info.partial:
        what += f" [peer lookup partial: {info.partial}]"
    return what


def user_lock_frame(t: ThreadView) -> int | None:
    """Index of the innermost Python frame, when it is the application's own code acquiring a lock
    (not threading.py's Condition/Event/join/queue machinery, nor a pool worker taking its next task:
    ``work_queue.get()`` of a SimpleQueue blocks on a lock from C, under the worker loop's own frame)."""
    if t.py_wait is not None:
        return None
    for i, f in enumerate(t.frames):
        if f.kind == "python":
            base = (f.file or "").rsplit("/", 1)[-1]
            if base in ("threading.py", "queue.py", "connection.py", "synchronize.py") or \
                    v.py_frame_in(f, v.TASK_QUEUE_FRAMES):
                return None
            return i
    return None


# Signals whose handlers are crash reporters or the interpreter's default (SIGINT), not a wake-up path.
_NOT_A_WAKEUP = frozenset({2, 4, 5, 6, 7, 8, 11, 31, 32, 33})   # 32, 33: glibc-internal (cancel, setxid)


def wake_signals(proc: ProcessEvidence | None) -> list[int]:
    """Signals the process catches that a service uses to be told something (SIGTERM, SIGHUP, SIGUSR1...)."""
    if proc is None or not proc.signals_caught:
        return []
    return [n for n in proc.signals_caught if n not in _NOT_A_WAKEUP]


def possible_signallers(views: list[ThreadView], exclude: list[ThreadView],
                         proc: ProcessEvidence | None = None) -> list[ThreadView]:
    """Threads that could still act: running, woken during the window, in a wait that ends by itself
    (timed waits, sleeps, waits for the outside world), on a futex another process can wake, or the
    main thread of a process with a signal handler installed (Python runs handlers there, and a
    handler that sets an Event or notifies is how daemons wait for SIGTERM)."""
    skip = {t.tid for t in exclude}
    handler = bool(wake_signals(proc))
    # An idle-by-design thread (a pool's result handler, an I/O thread) counts only when it can move.
    moving = (WaitKind.EVENT_WAIT, WaitKind.IO_READ, WaitKind.SLEEP)
    out = [t for t in views if t.tid not in skip and (
        t.running or t.woke or (t.timed and t.kind is not WaitKind.GIL_WAIT) or t.shared_futex
        or t.kind in moving or (t.kind is WaitKind.UNKNOWN and not t.idle_by_design))]
    # Without /proc the handlers are unknown: a main thread waiting on an Event/Condition (not a join)
    # may be waiting for one.
    unknown = proc is None or proc.signals_caught is None
    out += [t for t in views if t.is_main and t not in out and t.kind in (WaitKind.PY_LOCK_WAIT, WaitKind.FUTEX_WAIT)
            and any(f.kind == "python" for f in t.frames) and (handler or (unknown and t.py_wait == "py_cond"))]
    return out


def proc_missing(proc: ProcessEvidence) -> bool:
    """Nothing of ``proc`` was read from /proc: no sample window, no thread state, CPU or fd."""
    return proc.progress is None and all(t.state is ThreadState.UNKNOWN and t.cpu_ticks_delta is None
                                         for t in proc.threads)


def missing_evidence(proc: ProcessEvidence) -> str:
    if proc_missing(proc):
        return ("/proc was not read (its fd peers, which tell the server end of a connection from a client's, "
                "and the sample window, which shows whether anything moves)")
    return ("the fd it reads was not resolved to a connection and its peer (/proc saw the thread elsewhere, or "
            "the fd could not be read), so neither the server/client role nor the sample window covers this read")


STACKS_ONLY = "+ judged from stack samples alone"
