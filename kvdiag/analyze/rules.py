"""Rules: classified threads and engine records → a Verdict. Pure functions, no I/O, no clock.

Process rules, strongest first: GIL cycle, lock-order inversion, blocked IPC
read, lost wakeup, then "stopped / GIL waiters without a known holder"
(unknown). Engine rules add what only the run knows: OOM and crash text,
exit codes, the decode-stall metrics signature and start-up progress.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvdiag.analyze import vocab as v
from kvdiag.analyze.access import evidence_outcome, found_state, judgeable
from kvdiag.analyze.classify import ThreadView, WaitKind, classify_process
from kvdiag.analyze.enginelog import starting_verdict, telling_line
from kvdiag.analyze.evidence import (
    BLOCKED_KEYS,
    CONTEXT_KEYS,
    GIL_WAITER_KEYS,
    HOLDER_KEYS,
    Key,
    cite,
    cite_item,
    where,
)
from kvdiag.analyze.gpu import gpu_wait_progressed, rule_gpu_idle_wait, rule_gpu_kernel_hang
from kvdiag.analyze.runtime import may_release_python_lock
from kvdiag.analyze.vllm_titles import process_title
from kvdiag.analyze.waitgraph import WaitGraph
from kvdiag.defaults import KV_FULL, STALL_WINDOW_S
from kvdiag.logs.banner import assess_risk_for
from kvdiag.logs.lines import CRASH_AT_EXIT, OOM_AT_EXIT
from kvdiag.model import (
    Bundle,
    Confidence,
    EnginePhase,
    EngineRecord,
    EvidenceItem,
    FdInfo,
    Finding,
    MetricsSnapshot,
    ProcessEvidence,
    ProcessRole,
    ThreadState,
    Verdict,
    VerdictKind,
)

# Worst first: the overall verdict is the worst engine's.
# Worst first; each kind's rank is part of its one definition (KIND_SPECS in kvdiag.model).
SEVERITY: tuple[VerdictKind, ...] = tuple(sorted(VerdictKind, key=lambda k: k.spec.rank))
_TARGET_STATES = (VerdictKind.STOPPED, VerdictKind.TRACED)
_HOLDER_BLOCKED = frozenset({WaitKind.COND_WAIT, WaitKind.MUTEX_WAIT, WaitKind.FUTEX_WAIT, WaitKind.IO_READ,
                             WaitKind.PY_LOCK_WAIT})
_WAIT_WORDS = {
    WaitKind.COND_WAIT: "waiting on a condition variable", WaitKind.MUTEX_WAIT: "waiting for a mutex",
    WaitKind.FUTEX_WAIT: "blocked in a futex wait", WaitKind.IO_READ: "blocked reading a socket/pipe",
    WaitKind.PY_LOCK_WAIT: "blocked on a lock", WaitKind.GIL_WAIT: "waiting for the GIL",
}
_PY_INTERNAL_LOCK_FRAMES = ("PyThread_acquire_lock_timed", "acquire_timed", "lock_PyThread_acquire_lock")

_ROLE_TEXT = {ProcessRole.ENGINE_CORE: "the EngineCore", ProcessRole.API_SERVER: "the API server",
              ProcessRole.WORKER: "a Worker"}


def _where(proc: ProcessEvidence) -> str:
    """``pid N`` plus which process of which engine it is, when known: the report says which process of a
    vLLM tree holds the hang (the EngineCore, not the API server the user launched)."""
    role = _ROLE_TEXT.get(proc.role)
    at = f" on node {proc.node}" if proc.node else ""
    if role is None:
        return f"pid {proc.pid}{at}"
    if proc.role is ProcessRole.WORKER and (title := process_title(proc)) and title != "Worker":
        role = title   # which rank a tensor-parallel worker is (Worker_TP1), not just "a Worker"
    return f"pid {proc.pid}{at} ({role}{' of engine ' + proc.engine if proc.engine else ''})"



def severity(kind: VerdictKind) -> int:
    return SEVERITY.index(kind)


# ---------------------------------------------------------------- helpers


def _tnode(g: WaitGraph, t: ThreadView, doing: str = "") -> str:
    """Thread node; the first caller's ``doing`` becomes part of its label."""
    return g.node(f"T{t.pid}:{t.tid:08d}", f"{t.label}: {doing}" if doing else t.label)


def _obj_label(t: ThreadView) -> str:
    word = {WaitKind.COND_WAIT: "condvar", WaitKind.MUTEX_WAIT: "mutex", WaitKind.IO_READ: "read",
            WaitKind.PY_LOCK_WAIT: "lock"}.get(t.kind, "futex")
    return f"{word} {t.wait_addr:#x}" if t.wait_addr else f"{word} of thread {t.tid}"


def _onode(g: WaitGraph, t: ThreadView) -> str:
    key = f"{t.wait_addr:x}" if t.wait_addr else f"t{t.tid}"
    return g.node(f"OBJ{t.pid}:{key}", _obj_label(t))


def _has_frame(view: ThreadView, needle: str) -> bool:
    return any(needle in f.name for f in view.frames)


def _holder_role(h: ThreadView) -> str:
    what = _WAIT_WORDS.get(h.kind, "blocked")
    if _has_frame(h, "alloc_page"):
        return f"alloc_page caller (holds the GIL, {what})"
    return f"GIL holder ({what})"


def _waiter_role(w: ThreadView) -> str:
    if _has_frame(w, "map_pages"):
        return "prealloc worker in map_pages (waits for the GIL)"
    if _has_frame(w, "prealloc_worker"):
        return "prealloc worker (waits for the GIL)"
    return "waits for the GIL"


def _item(t: ThreadView, role: str, engine: str | None, keys: tuple[Key, ...]) -> EvidenceItem:
    """The thread's cited frames; ``keys`` says which of them this rule's conclusion rests on."""
    return cite_item(t, role, engine, keys)


# ---------------------------------------------------------------- process rules


def _pick_holder(views: list[ThreadView]) -> ThreadView | None:
    holders = [t for t in views if t.holds_gil]
    if not holders:
        return None
    for src in ("pystack", "proc", "py-spy", "merged"):
        ranked = [t for t in holders if src in t.gil_holder_sources]
        if ranked:
            blocked = [t for t in ranked if not t.running]
            return (blocked or ranked)[0]
    return holders[0]


def _infer_holder(views: list[ThreadView]) -> ThreadView | None:
    """Without an interpreter flag: the one blocked, non-idle thread that did not release the GIL."""
    if any(t.running and not t.idle_by_design for t in views):
        return None
    cands = [t for t in views if not t.waits_gil and not t.idle_by_design and not t.running
             and t.kind in (WaitKind.COND_WAIT, WaitKind.MUTEX_WAIT, WaitKind.FUTEX_WAIT, WaitKind.IO_READ)
             and not any(f.name in _PY_INTERNAL_LOCK_FRAMES for f in t.frames)]
    return cands[0] if len(cands) == 1 else None


def _released_gil(t: ThreadView) -> bool:
    """A Python-level lock wait has released the GIL; such a thread cannot be holding it."""
    return t.kind is WaitKind.PY_LOCK_WAIT and any(v.norm(f.name) in _PY_INTERNAL_LOCK_FRAMES for f in t.frames)


def _outside_peer(t: ThreadView, pid: int) -> bool:
    """The read can end without any thread of ``pid``: its peer is another process, none, or unknown."""
    conns = [f for f in t.blocked_fds if f.kind in ("socket", "pipe") and not f.listening]
    return not conns or all(f.peer_pids != [pid] for f in conns)


def peer_phrase(info: FdInfo) -> str:
    """``tcp socket 127.0.0.1:5 -> 127.0.0.1:6 (peer: pid 123 python3)``: one phrase for a report."""
    what = f"{info.proto} socket" if info.kind == "socket" and info.proto else info.kind
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
    if info.partial:
        what += f" [peer lookup partial: {info.partial}]"
    return what


def rule_target_state(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    """A stopped or foreign-traced target: its own outcome; the stacks' story, if any, as a finding.

    The state and tracer come from /proc, else from the preflight's reading of the target as found, else
    (traced) from every ptrace tool being refused although the preflight found attaching allowed."""
    found = found_state(proc)
    stopped = found.stopped or bool(views) and all(t.stopped or t.kind is WaitKind.STOPPED for t in views)
    tracer = found.tracer_pid
    if not stopped and tracer is None and not found.traced_inferred:
        return None
    inner = _first_verdict(proc, views, engine)
    if inner is not None and inner.kind in (VerdictKind.UNKNOWN, VerdictKind.INCONCLUSIVE):
        inner = None    # "nothing runs" says nothing about a process that cannot run
    also = f"; its stacks show {inner.kind.value}: {inner.summary}" if inner is not None else ""
    findings = [Finding(kind="mechanism", pid=proc.pid, engine=engine, message=inner.kind.value)] if inner else []
    evidence = inner.evidence if inner is not None else [_item(t, "stopped" if stopped else "traced", engine,
                                                                                 BLOCKED_KEYS)
                                                         for t in views[:2]]
    if stopped and tracer is None:
        return Verdict(kind=VerdictKind.STOPPED, confidence=Confidence.HIGH, engine=engine, evidence=evidence,
                       findings=findings, cycle=inner.cycle if inner else [],
                       summary=(f"{_where(proc)} is stopped (SIGSTOP, job control or a debugger): none of its "
                                f"threads can run until it gets SIGCONT; capture left it stopped{also}"))
    if tracer is None:
        refused = "; ".join(f"{t.tool}: {t.error}" for t in proc.tools if not t.ok and t.error)
        return Verdict(kind=VerdictKind.TRACED, confidence=Confidence.MEDIUM, engine=engine, evidence=evidence,
                       findings=findings, cycle=inner.cycle if inner else [],
                       confidence_reasons=["- its TracerPid was not read (/proc not captured)"],
                       summary=(f"{_where(proc)} is most likely traced by another debugger: the preflight found "
                                f"attaching allowed, yet the kernel refused every ptrace tool ({refused}), which "
                                f"it does when a tracer already holds the process; nothing was judged{also}"))
    return Verdict(kind=VerdictKind.TRACED, confidence=Confidence.HIGH, engine=engine, evidence=evidence,
                   findings=findings, cycle=inner.cycle if inner else [],
                   summary=(f"{_where(proc)} is traced by pid {tracer} (another debugger or strace)"
                            f"{' and stopped by it' if stopped else ''}: kvdiag's ptrace tools cannot attach and "
                            f"the tracer may be holding it; left as found{also}"))


def _gil_waiters(views: list[ThreadView], holder: ThreadView) -> list[ThreadView]:
    return [t for t in views if t.kind is WaitKind.GIL_WAIT and t.tid != holder.tid]


def gil_held_blocked(proc: ProcessEvidence, views: list[ThreadView]) -> tuple[ThreadView, str] | None:
    """(holder, how long) when a thread holds the GIL across a blocking call for the whole sample window."""
    holder = _pick_holder(views)
    if holder is None or holder.running or holder.woke or _released_gil(holder):
        return None
    if holder.kind not in _HOLDER_BLOCKED | {WaitKind.SLEEP, WaitKind.EVENT_WAIT} or holder.kind is WaitKind.GIL_WAIT:
        return None
    samples = proc.progress.gil_holders if proc.progress is not None else []
    window = proc.progress.window_s if proc.progress is not None else 0.0
    if len(samples) >= 2 and all(s == holder.tid for s in samples):
        how = f"held at both samples {window:.2f}s apart, no wakeup in between"
    elif holder.quiet:
        how = f"no CPU and no wakeup for the {window:.2f}s sample window"
    elif holder.timed:
        return None    # a timed wait without window data: it may well let go soon
    else:
        how = "one sample (no sample window recorded)"
    return holder, how


def rule_gil_held_blocked(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    found = gil_held_blocked(proc, views)
    if found is None:
        return None
    holder, how = found
    waiters = _gil_waiters(views, holder)
    if not waiters:
        return None
    block = _WAIT_WORDS.get(holder.kind, {WaitKind.SLEEP: "sleeping", WaitKind.EVENT_WAIT: "polling"}.get(
        holder.kind, "blocked"))
    peer = "".join(f"; reading {peer_phrase(f)}" for f in holder.blocked_fds[:1]) if holder.blocked_fds else ""
    conf = Confidence.HIGH if any(s in ("pystack", "proc") for s in holder.gil_holder_sources) else Confidence.MEDIUM
    evidence = [_item(holder, f"holds the GIL while {block} ({how}){peer}", engine, HOLDER_KEYS)]
    evidence += [_item(w, _waiter_role(w) + f" [{'; '.join(w.gil_wait_signals)}]", engine, GIL_WAITER_KEYS)
                 for w in waiters[:4]]
    names = ", ".join(w.label for w in waiters[:3]) + (f" and {len(waiters) - 3} more" if len(waiters) > 3 else "")
    return Verdict(kind=VerdictKind.GIL_HELD_BLOCKED, confidence=conf, engine=engine, evidence=evidence,
                   summary=(f"GIL held while blocked in {_where(proc)}: {holder.label} holds the GIL while {block}"
                            f"{where(holder)} ({how}){peer}; {len(waiters)} Python thread(s) wait for it: {names}. "
                            f"No line of Python runs until that call returns"))


def gil_held_warning(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Finding | None:
    """The same shape without waiters: not a stall yet, but the next thread that wants the GIL stalls."""
    found = gil_held_blocked(proc, views)
    if found is None or _gil_waiters(views, found[0]):
        return None
    holder, how = found
    block = _WAIT_WORDS.get(holder.kind, {WaitKind.SLEEP: "sleeping"}.get(holder.kind, "blocked"))
    return Finding(kind="gil_held_blocked", pid=proc.pid, engine=engine, message=(
        f"{holder.label} holds the GIL while {block}{where(holder)} ({how}); no other thread wants it yet, but "
        f"until that call returns no line of Python can run in {_where(proc)}: the first request, callback or "
        f"timer that needs the interpreter will stall behind it. Release the GIL around blocking calls "
        f"(Py_BEGIN_ALLOW_THREADS, py::gil_scoped_release, nb::gil_scoped_release). Holder's frames: "
        f"{' ← '.join(cite(holder, 8)) or 'none read'}"))


def rule_gil_cycle(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    waiters = [t for t in views if t.kind is WaitKind.GIL_WAIT]
    if not waiters:
        return None
    holder = _pick_holder(views)
    inferred = False
    if holder is None:
        holder = _infer_holder(views)
        inferred = holder is not None
    if (holder is None or holder.running or holder.timed or holder.woke or holder.kind not in _HOLDER_BLOCKED
            or _released_gil(holder)):
        return None   # a timed wait ends by itself: GIL-heavy, not a cycle
    if holder.kind is WaitKind.IO_READ and _outside_peer(holder, proc.pid):
        return None   # the read ends when another process writes: no thread of ours needs to run
    waiters = [w for w in waiters if w.tid != holder.tid]
    if not waiters:
        return None
    g = WaitGraph()
    gil = g.node(f"GIL{proc.pid}", f"the GIL of pid {proc.pid}")
    h = _tnode(g, holder, f"holds the GIL, {_WAIT_WORDS.get(holder.kind, 'blocked')}{where(holder, 1)}")
    g.edge(gil, h, "held by")
    for w in waiters:
        g.edge(_tnode(g, w, f"waits for the GIL{where(w, 1)}"), gil, "waits for")
    obj = _onode(g, holder)
    g.edge(h, obj, "waits on")
    by_tid = {t.tid: t for t in views}
    if holder.kind is WaitKind.MUTEX_WAIT and holder.owner_tid in by_tid:
        g.edge(obj, _tnode(g, by_tid[holder.owner_tid]), "owned by")
    else:
        # Nobody else can run: the object can only be released by a thread that first needs the GIL.
        for w in waiters:
            if not w.idle_by_design:
                g.edge(obj, _tnode(g, w), "can only be signalled by", inferred=True)
    cycles = [c for c in g.cycles() if gil in c]
    if not cycles:
        return None
    # The waiter that can wake the holder first: it runs in the holder's native library (the prealloc
    # worker in map_pages), not a Python thread that merely queues for the GIL (process_output_sockets
    # in queue.get). The cycle drawn and cited is the one through that waiter, not the first found.
    best = sorted(waiters, key=lambda w: (
        not (w.libraries & holder.libraries), not _has_frame(w, "map_pages"), any(f.kind == "python" for f in
                                                                                   w.frames), w.tid))
    nodes = [_tnode(g, w) for w in best]
    cycle = min(cycles, key=lambda c: (next((i for i, n in enumerate(nodes) if n in c), len(nodes)), len(c)))
    in_cycle = [w for w, n in zip(best, nodes, strict=True) if n in cycle]
    ranked = in_cycle or best
    main_waiter = ranked[0]
    strong_holder = any(s in ("pystack", "proc") for s in holder.gil_holder_sources)
    strong_waiter = any(len(w.gil_wait_signals) >= 2 for w in ranked)
    holder_frames = holder.wait_frame is not None and not holder.wait_frame.startswith(("wchan", "syscall"))
    if strong_holder and strong_waiter and holder_frames:
        conf = Confidence.HIGH
    elif inferred and not strong_waiter:
        conf = Confidence.LOW
    else:
        conf = Confidence.MEDIUM
    more = f" (+{len(ranked) - 1} more GIL waiter{'s' if len(ranked) > 2 else ''})" if len(ranked) > 1 else ""
    how = " (holder inferred: no interpreter flag)" if inferred else ""
    summary = (f"GIL cycle in {_where(proc)}: {holder.label} holds the GIL while "
               f"{_WAIT_WORDS.get(holder.kind, 'blocked')}{where(holder)}; {main_waiter.label} waits for the "
               f"GIL{where(main_waiter)}{more}{how}")
    # The holder rests on its blocking call, its project frame and the Python call that entered it; a
    # waiter on its GIL acquire and the project code that wants the GIL (map_pages, the callback).
    evidence = [_item(holder, _holder_role(holder), engine, HOLDER_KEYS)]
    evidence += [_item(w, _waiter_role(w) + f" [{'; '.join(w.gil_wait_signals)}]", engine, GIL_WAITER_KEYS)
                 for w in ranked[:4]]
    return Verdict(kind=VerdictKind.GIL_CYCLE, summary=summary, confidence=conf, evidence=evidence,
                   engine=engine, cycle=g.describe_cycle(cycle))


def _user_lock_frame(t: ThreadView) -> int | None:
    """Index of the innermost Python frame, when it is the application's own code acquiring a lock
    (not threading.py's Condition/Event/join/queue machinery)."""
    if t.py_wait is not None:
        return None
    for i, f in enumerate(t.frames):
        if f.kind == "python":
            base = (f.file or "").rsplit("/", 1)[-1]
            return None if base in ("threading.py", "queue.py", "connection.py", "synchronize.py") else i
    return None


# Signals whose handlers are crash reporters or the interpreter's default (SIGINT), not a wake-up path.
_NOT_A_WAKEUP = frozenset({2, 4, 5, 6, 7, 8, 11, 31, 32, 33})   # 32, 33: glibc-internal (cancel, setxid)


def wake_signals(proc: ProcessEvidence | None) -> list[int]:
    """Signals the process catches that a service uses to be told something (SIGTERM, SIGHUP, SIGUSR1...)."""
    if proc is None or not proc.signals_caught:
        return []
    return [n for n in proc.signals_caught if n not in _NOT_A_WAKEUP]


def _possible_signallers(views: list[ThreadView], exclude: list[ThreadView],
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


_ACQUIRE_LINE = re.compile(r"^\s*(?:async\s+)?with\s+([A-Za-z_]\w*)\s*(?:[:,]|as\b)|\b([A-Za-z_]\w*)\.acquire\(")


def _awaited_lock(t: ThreadView) -> int | None:
    """Address of the lock ``t`` waits to acquire: the name its innermost lock-taking line acquires
    (``with second:``, ``second.acquire()``), looked up in that frame's lock-typed locals."""
    for f in t.lock_frames:
        m = _ACQUIRE_LINE.search(f.source or "")
        name = (m.group(1) or m.group(2)) if m else None
        if name and name in f.locks:
            return f.locks[name]
    return None


def _lock_reference_cycle(waiters: list[ThreadView], views: list[ThreadView]) -> list[tuple[ThreadView, int, int]]:
    """[(waiter, lock it waits for, lock it holds)] around a cycle, when each waiter's lock is referenced
    (pystack-locals) by exactly one other thread that does not itself wait for it: that thread holds it,
    as far as references tell. Empty when the references do not close a cycle."""
    awaited = {t.tid: a for t in waiters if (a := _awaited_lock(t)) is not None}
    if len(awaited) < 2:
        return []
    by_tid = {t.tid: t for t in views}
    holder: dict[int, int] = {}
    for t in waiters:
        want = awaited.get(t.tid)
        if want is None:
            continue
        refs = [u.tid for u in views if u.tid != t.tid and awaited.get(u.tid) != want
                and any(want in f.locks.values() for f in u.lock_frames)]
        if len(refs) == 1:
            holder[t.tid] = refs[0]
    for start in holder:
        path, tid = [start], holder[start]
        while tid in holder and tid not in path:
            path.append(tid)
            tid = holder[tid]
        if tid == start and len(path) >= 2:
            return [(by_tid[x], awaited[x], awaited[path[i - 1]]) for i, x in enumerate(path)]
    return []


def rule_python_lock_inversion(proc: ProcessEvidence, views: list[ThreadView],
                               engine: str | None) -> Verdict | None:
    """Python locks record no owner: when two or more threads block, untimed, acquiring different locks
    from their own code and no thread can still act, each must hold what another wants (inferred)."""
    waiters = [t for t in views if t.kind in (WaitKind.PY_LOCK_WAIT, WaitKind.FUTEX_WAIT) and not t.timed
               and not t.running and not t.woke and not t.idle_by_design and not t.shared_futex
               and _user_lock_frame(t) is not None]
    addrs = {t.wait_addr for t in waiters if t.wait_addr}
    if len(waiters) < 2 or (addrs and len(addrs) < 2):
        return None
    # Only a thread that can run Python releases a Python lock (kvdiag.analyze.runtime: a runtime's native threads).
    if any(may_release_python_lock(t, waiters) for t in _possible_signallers(views, waiters, proc)) or any(
            t.kind is WaitKind.GIL_WAIT for t in views):
        return None
    ring = _lock_reference_cycle(waiters, views)
    if ring:
        g = WaitGraph()
        for t, want, has in ring:
            _tnode(g, t, f"holds lock {has:#x} (referenced in its frames), waits for lock {want:#x}{where(t, 1)}")
        for t, want, _ in ring:
            owner = next(u for u, _, has in ring if has == want)
            obj = g.node(f"PYLOCK{proc.pid}:{want:x}", f"Python lock {want:#x}")
            g.edge(_tnode(g, t), obj, "waits for")
            g.edge(obj, _tnode(g, owner), "held by (inferred from references)", inferred=True)
        cycle = min(g.cycles(), key=len) if g.cycles() else []
        desc = "; ".join(f"{t.label} holds lock {has:#x} and waits for {want:#x}{where(t, 1)}" for t, want, has in ring)
        evidence = [_item(t, f"waits for Python lock {want:#x}; holds {has:#x} (its frames reference it and it "
                             "does not wait for it)", engine, BLOCKED_KEYS) for t, want, has in ring[:4]]
        return Verdict(kind=VerdictKind.LOCK_ORDER_INVERSION, confidence=Confidence.MEDIUM, engine=engine,
                       evidence=evidence, cycle=g.describe_cycle(cycle) if cycle else [],
                       confidence_reasons=["+ each lock's holder named by its references (pystack --locals, lock "
                                           "objects only)", "- Python locks record no owner: holding is inferred "
                                           "from references, not read"],
                       summary=(f"lock-order inversion between Python locks in {_where(proc)}: {desc}. Python locks "
                                f"record no owner; each holder is the one other thread whose frames reference the "
                                f"lock without waiting for it (pystack --locals), and no other thread can run"))
    lines = []
    for t in waiters:
        i = _user_lock_frame(t)
        f = t.frames[i] if i is not None else None
        at = f" at {v.describe(f)}" + (f" `{f.source.strip()}`" if f is not None and f.source else "") if f else ""
        lines.append((t, at))
    conf = Confidence.MEDIUM if len(addrs) == len(waiters) else Confidence.LOW
    desc = "; ".join(f"{t.label} waits for a lock{at}" for t, at in lines)
    evidence = [_item(t, f"waits for Python lock {t.wait_addr:#x}" if t.wait_addr else "waits for a Python lock",
                      engine, BLOCKED_KEYS) for t in waiters[:4]]
    return Verdict(kind=VerdictKind.LOCK_ORDER_INVERSION, confidence=conf, engine=engine, evidence=evidence,
                   summary=(f"likely lock-order inversion between Python locks in {_where(proc)}: {desc}. "
                            f"Python locks record no owner, so who holds which is inferred: no other thread "
                            f"can run, so each waiter must hold a lock another one wants (confidence "
                            f"{conf.value})"))


def rule_lock_inversion(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    waiters = [t for t in views if t.kind is WaitKind.MUTEX_WAIT and not t.running and not t.timed and not t.woke]
    if len(waiters) < 2:
        return rule_python_lock_inversion(proc, views, engine)
    g = WaitGraph()
    by_tid = {t.tid: t for t in views}
    held: dict[int, list[str]] = {}
    for t in waiters:
        if t.owner_tid is not None and t.wait_addr:
            held.setdefault(t.owner_tid, []).append(f"{t.wait_addr:#x}")
    for t in waiters:   # label every waiter first: the first label given to a node sticks
        holds = f"holds mutex {', '.join(held[t.tid])}, " if t.tid in held else ""
        _tnode(g, t, f"{holds}waits for mutex {t.wait_addr:#x}" if t.wait_addr else "")
    for t in waiters:
        obj = _onode(g, t)
        g.edge(_tnode(g, t), obj, "waits for")
        if t.owner_tid in by_tid:
            g.edge(obj, _tnode(g, by_tid[t.owner_tid]), "owned by")
    cycles = g.cycles()
    if cycles:
        cycle = min(cycles, key=len)
        members = [t for t in waiters if _tnode(g, t) in cycle]
        from_frames = all(m.wait_frame and not m.wait_frame.startswith(("wchan", "syscall")) for m in members)
        conf = Confidence.HIGH if from_frames else Confidence.MEDIUM
        desc = "; ".join(f"{m.label} holds mutex {', '.join(held.get(m.tid, ['?']))} and waits for "
                         f"{m.wait_addr:#x}{where(m, 1)}" for m in members if m.wait_addr)
        evidence = [_item(m, f"holds mutex {', '.join(held.get(m.tid, ['?']))}, waits for mutex "
                             f"{m.wait_addr:#x}" if m.wait_addr else "waits for a mutex", engine, BLOCKED_KEYS)
                    for m in members]
        return Verdict(kind=VerdictKind.LOCK_ORDER_INVERSION, confidence=conf, engine=engine,
                       summary=f"lock-order inversion in {_where(proc)}: {desc}", evidence=evidence,
                       cycle=g.describe_cycle(cycle))
    owners_known = any(t.owner_tid is not None for t in waiters)
    addrs = {t.wait_addr for t in waiters if t.wait_addr}
    # Without /proc there are no addresses at all: two untimed mutex waits from frames, with no
    # thread left that could release anything, still cannot end (low confidence).
    unread = not addrs and all(t.wait_addr is None for t in waiters) and not _possible_signallers(views, waiters)
    if not owners_known and (len(addrs) >= 2 or unread) and not any(t.running and not t.idle_by_design
                                                                     for t in views):
        evidence = [_item(t, f"waits for mutex {t.wait_addr:#x} (owner unknown)" if t.wait_addr else
                          "waits for a mutex (owner unknown)", engine, BLOCKED_KEYS) for t in waiters[:4]]
        return Verdict(kind=VerdictKind.LOCK_ORDER_INVERSION, confidence=Confidence.LOW, engine=engine,
                       summary=(f"likely lock-order inversion in {_where(proc)}: {len(waiters)} threads wait on "
                                f"{f'{len(addrs)} different mutexes' if addrs else 'mutexes'}"
                                f"{''.join(where(t, 1) for t in waiters[:1])} and nothing runs "
                                f"(owners could not be read)"),
                       evidence=evidence)
    return rule_python_lock_inversion(proc, views, engine)


def _awaits_orders(t: ThreadView, proc: ProcessEvidence) -> bool:
    """The read waits for the next request or command, not for a reply: every connection it waits on
    is the server end of an accepted connection, or leads to the process's parent (a worker waiting
    for its next task)."""
    conns = [f for f in t.blocked_fds if f.kind in ("socket", "pipe") and not f.listening]
    # A pipe's writers, when read, say it better than every holder of either end.
    return bool(conns) and all(f.accepted or (proc.ppid is not None and (
        f.writer_pids if f.kind == "pipe" and f.writer_pids is not None else f.peer_pids) == [proc.ppid])
        for f in conns)


def _loop_parked(t: ThreadView, pid: int) -> list[FdInfo] | None:
    """An event loop waiting with no timeout on connections only (no listening socket, no timer):
    the connected sockets/pipes it waits on, each with a peer, else None."""
    if t.kind is not WaitKind.EVENT_WAIT or not t.wait_forever or not t.blocked_fds:
        return None
    if any(f.listening or f.kind not in ("socket", "pipe") for f in t.blocked_fds):
        return None
    outside = [f for f in t.blocked_fds if f.peer_pids and f.peer_pids != [pid]]
    return outside or None


def rule_blocked_read(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    if any(t.running and not t.idle_by_design for t in views):
        return None
    if proc.progress is not None and proc.progress.advanced:
        return None   # it wrote its log or did I/O during the window: something still moves
    # A read only the stacks saw, where /proc had found the thread in something else moments before (asleep
    # between requests, say), is a thread that moved: not parked for good.
    readers = [t for t in views if t.kind is WaitKind.IO_READ and not t.idle_by_design and not t.tty_read
               and not t.woke and not _awaits_orders(t, proc) and t.read_role != "request"
               and not t.proc_saw_other and not t.samples_moved]
    loops = [(t, fds) for t in views if not t.idle_by_design and not t.woke and not _awaits_orders(t, proc)
             and t.read_role != "request" and (fds := _loop_parked(t, proc.pid))]
    if not readers and loops and not _possible_signallers(views, [t for t, _ in loops]):
        t, fds = loops[0]
        what = "asyncio event loop" if t.asyncio_loop else "event loop"
        on = "; ".join(peer_phrase(f) for f in fds[:3])
        return Verdict(kind=VerdictKind.BLOCKED_IPC_READ, confidence=Confidence.MEDIUM, engine=engine,
                       evidence=[_item(t, f"{what} parked with no timeout, waiting only on {on}", engine,
                                            BLOCKED_KEYS)],
                       summary=(f"blocked IPC read in {_where(proc)}: the {what} in {t.label} is parked in "
                                f"{t.wait_frame or 'epoll_wait'}{where(t)} with no timeout and no timer; its only "
                                f"event sources are connections that stay silent: {on}. The awaiting coroutine is not "
                                f"on any stack; it is the read on that connection"))
    if not readers:
        return None
    # A background reader thread is a receive loop (a server's input thread, an engine's output reader)
    # while another thread still acts: an event loop, a thread in a timed wait, one that woke. Only a
    # main thread (or the GIL holder) stuck in the read, or a reader nobody else can outlive, is a hang.
    event_loops = [t for t in views if t.kind is WaitKind.EVENT_WAIT and not t.idle_by_design]
    others_act = bool(event_loops) or bool(_possible_signallers(views, readers, proc))
    picked = [t for t in readers if t.is_main or t.holds_gil or not others_act]
    if not picked:
        return None
    r = sorted(picked, key=lambda t: (not t.holds_gil, not t.is_main, t.tid))[0]
    from_frames = r.wait_frame is not None and not r.wait_frame.startswith(("wchan", "syscall"))
    conns = [f for f in r.blocked_fds if f.kind in ("socket", "pipe")]
    if not conns and not r.proc_saw_read:
        # Neither the fd's peer nor the sample window covers this read (it came from the stacks alone).
        return _unresolved_read(proc, r, engine)
    is_socket = r.socket_read or any(f.kind == "socket" for f in conns)
    conf = Confidence.HIGH if (from_frames and (is_socket or conns)) else Confidence.MEDIUM
    what = peer_phrase(conns[0]) if conns else ("a socket" if r.socket_read else "a socket/pipe")
    evidence = [_item(r, f"blocked reading {what} with no timeout" + (" (holds the GIL)" if r.holds_gil else ""),
                      engine, BLOCKED_KEYS)]
    others = [t for t in views if t.tid != r.tid and not t.idle_by_design and t.kind in (
        WaitKind.PY_LOCK_WAIT, WaitKind.COND_WAIT, WaitKind.GIL_WAIT)]
    evidence += [_item(t, f"also blocked ({_WAIT_WORDS.get(t.kind, t.kind.value)})", engine, CONTEXT_KEYS)
                 for t in others[:3]]
    return Verdict(kind=VerdictKind.BLOCKED_IPC_READ, confidence=conf, engine=engine, evidence=evidence,
                   summary=(f"blocked IPC read in {_where(proc)}: {r.label} waits for data on {what}"
                            f"{where(r)} and no thread of the process is running"))


def proc_missing(proc: ProcessEvidence) -> bool:
    """Nothing of ``proc`` was read from /proc: no sample window, no thread state, CPU or fd."""
    return proc.progress is None and all(t.state is ThreadState.UNKNOWN and t.cpu_ticks_delta is None
                                         for t in proc.threads)


def _missing_evidence(proc: ProcessEvidence) -> str:
    if proc_missing(proc):
        return ("/proc was not read (its fd peers, which tell the server end of a connection from a client's, "
                "and the sample window, which shows whether anything moves)")
    return ("the fd it reads was not resolved to a connection and its peer (/proc saw the thread elsewhere, or "
            "the fd could not be read), so neither the server/client role nor the sample window covers this read")


STACKS_ONLY = "+ judged from stack samples alone"


def _unresolved_read(proc: ProcessEvidence, r: ThreadView, engine: str | None) -> Verdict:
    """A blocked read whose fd (and so its peer) is unknown: a client waiting for a reply that never comes
    and a server waiting for its next request look the same. Judged only when the Python frames say it
    waits for a reply and at least two stack tools found it in that read; otherwise inconclusive, naming
    what is missing."""
    missing = _missing_evidence(proc)
    if r.read_role == "reply" and r.samples_in_wait >= 2 and not r.samples_moved:
        return Verdict(kind=VerdictKind.BLOCKED_IPC_READ, confidence=Confidence.LOW, engine=engine,
                       evidence=[_item(r, "blocked reading with no timeout, waiting for a reply (from its frames; "
                                          f"{r.samples_in_wait} stack sample(s) in the same read)", engine,
                                      BLOCKED_KEYS)],
                       confidence_reasons=[f"- {missing}", "+ its frames are a client call waiting for a reply",
                                           f"+ {r.samples_in_wait} stack tools found it in the same read",
                                           STACKS_ONLY],
                       summary=(f"blocked IPC read in {_where(proc)}: {r.label} waits for a reply{where(r)} and no "
                                f"thread of the process is running; judged from its stacks only: {missing}"))
    what = {"reply": "its frames are a client call waiting for a reply, but only one stack sample shows it",
            None: "its frames do not say whether it waits for a reply or for the next request"}.get(r.read_role, "")
    return Verdict(kind=VerdictKind.INCONCLUSIVE, confidence=Confidence.LOW, engine=engine,
                   evidence=[_item(r, "blocked reading with no timeout (peer unknown)", engine, BLOCKED_KEYS)],
                   confidence_reasons=[f"- {missing}", f"- {what}"],
                   summary=(f"inconclusive: in {_where(proc)}, {r.label} blocks reading with no timeout{where(r)} "
                            f"and nothing else of the process runs, but {what}: an idle server and a client whose "
                            f"peer stopped answering look the same here. Missing: {missing}. Capture again with "
                            f"/proc readable (kvdiag's proc backend) to decide"))


def rule_unresolved_wait(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    """An event loop (poll/epoll/select, not accept) parked with a timeout and fds that were not read (no
    /proc), nothing else of the process able to act: idle with no clients, or an asyncio client awaiting a
    reply (the coroutine is on no stack). Neither healthy nor a deadlock: inconclusive."""
    if not proc_missing(proc) or any(t.running and not t.idle_by_design for t in views):
        return None
    loops = [t for t in views if t.kind is WaitKind.EVENT_WAIT and not t.idle_by_design and not t.timed
             and t.read_role is None and not t.blocked_fds and "accept" not in (t.wait_frame or "")
             and "sig" not in (t.wait_frame or "") and "pause" not in (t.wait_frame or "")]
    if not loops:
        return None
    others = [t for t in _possible_signallers(views, loops, proc) if t.kind is not WaitKind.EVENT_WAIT]
    if others:
        return None
    t = sorted(loops, key=lambda t: (not t.is_main, t.tid))[0]
    what = "asyncio event loop" if t.asyncio_loop else "event loop"
    missing = _missing_evidence(proc)
    return Verdict(kind=VerdictKind.INCONCLUSIVE, confidence=Confidence.LOW, engine=engine,
                   evidence=[_item(t, f"{what} parked; its timeout and fds unknown", engine, BLOCKED_KEYS)],
                   confidence_reasons=[f"- {missing}", "- a parked loop's coroutines are on no stack"],
                   summary=(f"inconclusive: the {what} in {t.label} of {_where(proc)} is parked in "
                            f"{t.wait_frame or 'a poll'} and nothing else of the process runs; without its timeout "
                            f"and the fds it waits on, a loop idle between clients and one awaiting a reply that "
                            f"never comes look the same (the awaiting coroutine is on no stack). Missing: "
                            f"{missing}. Capture again with /proc readable to decide"))


def rule_lost_wakeup(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    if any(t.kind is WaitKind.GIL_WAIT for t in views):
        return None   # GIL involved: not this rule's business
    if proc.progress is not None and proc.progress.advanced:
        return None   # it wrote its log or did I/O during the window
    live = [t for t in views if not t.idle_by_design]
    waiters = [t for t in live if not t.running and not t.timed and not t.woke and not t.shared_futex and (
        t.kind is WaitKind.COND_WAIT or t.kind is WaitKind.FUTEX_WAIT
        or (t.kind is WaitKind.PY_LOCK_WAIT and t.py_wait == "py_cond"))]
    if not waiters:
        return None
    # A thread in a timed wait, or one that woke during the window, may still signal.
    if _possible_signallers(views, [w for w in waiters if not w.is_main], proc):
        return None
    waiters.sort(key=lambda t: (t.is_main, t.tid))   # the main thread is usually the one joining
    native = [t for t in waiters if t.kind is WaitKind.COND_WAIT]
    first = (native or waiters)[0]
    if native:
        conf = Confidence.HIGH
    elif any(t.kind is WaitKind.PY_LOCK_WAIT for t in waiters):
        conf = Confidence.MEDIUM
    else:
        conf = Confidence.LOW
    evidence = [_item(t, f"waits on {'condition variable' if t.kind is WaitKind.COND_WAIT else 'a futex'}"
                         f"{f' {t.wait_addr:#x}' if t.wait_addr else ''} that no live thread will signal", engine,
                      BLOCKED_KEYS)
                for t in (native or waiters)[:3]]
    evidence += [_item(t, f"also blocked ({_WAIT_WORDS.get(t.kind, t.kind.value)})", engine, CONTEXT_KEYS)
                 for t in live if t not in waiters and t.kind in _HOLDER_BLOCKED][:3]
    return Verdict(kind=VerdictKind.LOST_WAKEUP, confidence=conf, engine=engine, evidence=evidence,
                   summary=(f"lost wakeup in {_where(proc)}: {first.label} waits on a condition variable"
                            f"{where(first)}; every other thread is blocked too, so nobody can signal it"))


def rule_stuck_unknown(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    if proc.progress is not None and (proc.progress.advanced or len(set(proc.progress.gil_holders)) > 1):
        return None   # it did I/O, or the GIL changed hands during the window
    if any(t.woke for t in views):
        return None   # a thread that woke may be the holder we could not name
    waiters = [t for t in views if t.kind is WaitKind.GIL_WAIT]
    if waiters and not any(t.running for t in views):
        holder = _pick_holder(views)
        if holder is not None and holder.timed:
            return None   # the holder's wait times out: the GIL will move
        what = (f"{holder.label} holds it but shows no wait we can name" if holder is not None
                else "the GIL holder could not be identified")
        evidence = ([_item(holder, "GIL holder", engine, BLOCKED_KEYS)] if holder is not None else [])
        evidence += [_item(w, _waiter_role(w), engine, GIL_WAITER_KEYS) for w in waiters[:4]]
        return Verdict(kind=VerdictKind.UNKNOWN, confidence=Confidence.LOW, engine=engine, evidence=evidence,
                       summary=f"{_where(proc)}: {len(waiters)} thread(s) wait for the GIL and nothing runs; {what}")
    return None


_INTERNAL_WAITS = (WaitKind.COND_WAIT, WaitKind.MUTEX_WAIT, WaitKind.PY_LOCK_WAIT, WaitKind.FUTEX_WAIT)


def rule_nothing_can_move(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    """No rule named the shape, but every thread waits, untimed and unwoken, on something only another
    waiting thread of this process could release (a lock it holds itself, a join of a blocked thread,
    a Python lock with no owner field): hung, kind unknown."""
    if proc.progress is not None and proc.progress.advanced:
        return None
    live = [t for t in views if not t.idle_by_design]
    if not live or not all(t.kind in _INTERNAL_WAITS and not t.timed and not t.woke and not t.running
                           and not t.shared_futex for t in live):
        return None
    if _possible_signallers(views, [], proc):
        return None
    if not any(t.has_frames or t.wait_addr for t in live):
        return None      # the kernel's view alone cannot tell a lock from an idle futex
    live.sort(key=lambda t: (t.is_main, _user_lock_frame(t) is None, t.tid))   # the application's own wait first
    self_held = [t for t in live if t.kind is WaitKind.MUTEX_WAIT and t.wait_addr and t.owner_tid is None
                 and len(live) == 1]
    what = (f"{live[0].label} waits for a lock that only it could release" if len(live) == 1 else
            f"all {len(live)} threads wait, with no timeout, on locks, condition variables or joins that only "
            f"another of them could release")
    evidence = [_item(t, f"{_WAIT_WORDS.get(t.kind, 'blocked')} (no timeout, no wakeup)", engine, BLOCKED_KEYS)
                for t in live[:4]]
    return Verdict(kind=VerdictKind.UNKNOWN, confidence=Confidence.MEDIUM if not self_held else Confidence.LOW,
                   engine=engine, evidence=evidence,
                   summary=(f"pid {proc.pid} cannot make progress: {what}{where(live[0])}; no thread runs, woke, "
                            f"waits with a timeout or for the outside world, and no signal handler could end "
                            f"a wait"))


# A thread parked on a busy GPU goes first: the host waits around it are its consequences.
PROCESS_RULES = (rule_gpu_kernel_hang, rule_gil_cycle, rule_gil_held_blocked, rule_lock_inversion, rule_blocked_read,
                 rule_lost_wakeup, rule_gpu_idle_wait, rule_stuck_unknown, rule_nothing_can_move, rule_unresolved_wait)


def _first_verdict(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    """The first decisive rule's verdict; an inconclusive one only when no rule decides."""
    pending: Verdict | None = None
    for rule in PROCESS_RULES:
        verdict = rule(proc, views, engine)
        if verdict is None:
            continue
        if verdict.kind is not VerdictKind.INCONCLUSIVE:
            return verdict
        pending = pending or verdict
    return pending


def analyze_process(proc: ProcessEvidence, machine: str | None = None, engine: str | None = None) -> Verdict | None:
    """The first rule that matches ``proc``'s threads, or None (no hang evidence).

    A stopped or foreign-traced target gets its own outcome first. Every rule that infers a hang
    from "nothing can move" checks the sample window: a thread that woke or used CPU, or a
    process that wrote its log or did I/O, is not parked for good.
    """
    if not proc.alive:
        return None
    if not proc.threads:   # no stack read: only the target's state (as found) can be said
        return rule_target_state(proc, [], engine)
    views = classify_process(proc, machine)
    state = rule_target_state(proc, views, engine)
    if state is not None:
        return state
    return _first_verdict(proc, views, engine)


def process_findings(proc: ProcessEvidence, machine: str | None = None, engine: str | None = None) -> list[Finding]:
    """Warnings about a process that are not a verdict: a GIL held across a blocking call with no
    waiter yet, and what the progress sample saw."""
    if not proc.alive or not proc.threads:
        return []
    out: list[Finding] = []
    views = classify_process(proc, machine)
    warn = gil_held_warning(proc, views, engine)
    if warn is not None:
        out.append(warn)
    p = proc.progress
    if p is not None and p.advanced:
        grew = ", ".join(f"{path.rsplit('/', 1)[-1]} +{n} B" for path, n in p.log_growth.items() if n > 0)
        io = ", ".join(f"{k} +{n}" for k, n in p.io_delta.items() if n > 0)
        moved = "; ".join(x for x in (grew, io) if x)
        out.append(Finding(kind="progress", pid=proc.pid, engine=engine, message=(
            f"pid {proc.pid} advanced during the {p.window_s:.2f}s sample window ({moved}): not called a "
            "deadlock unless a cycle of owners is proven")))
    return out


# ---------------------------------------------------------------- engine rules


def _engine_text(e: EngineRecord) -> str:
    return "\n".join([e.error or "", e.last_log_line or "", *e.log_tail])


def decode_stalled(e: EngineRecord, metrics: Iterable[MetricsSnapshot], window_s: float) -> str | None:
    """A sentence when the metrics show requests running, KV near full and no new tokens for ``window_s``."""
    snaps = sorted((m for m in metrics if m.engine in (e.name, None)), key=lambda m: m.t)
    snaps = [m for m in snaps if m.generation_tokens is not None]
    if len(snaps) < 2 or not (e.healthy or e.phase in (EnginePhase.SERVING, EnginePhase.STALLED)):
        return None
    last = snaps[-1]
    if (last.running or 0) <= 0 or (last.kv_cache_usage or 0) < KV_FULL:
        return None
    i = len(snaps) - 1
    while i > 0 and snaps[i - 1].generation_tokens == last.generation_tokens:
        i -= 1
    flat = last.t - snaps[i].t
    if flat < window_s or not all((m.running or 0) > 0 for m in snaps[i:]):
        return None
    return (f"{last.running:.0f} request(s) running, KV cache {last.kv_cache_usage:.1%} full, "
            f"no token generated for {flat:.1f}s")


_STATS = re.compile(r"Avg generation throughput: (?P<gen>[\d.]+) tokens/s, Running: (?P<run>\d+) reqs?, "
                    r"Waiting: (?P<wait>\d+) reqs?, GPU KV cache usage: (?P<kv>[\d.]+)%")
STALL_STATS_LINES = 3


def decode_stalled_from_log(e: EngineRecord) -> str | None:
    """vLLM's periodic stats lines: the last few all say requests running, KV near full, 0 tokens/s."""
    stats = [m for ln in e.log_tail if (m := _STATS.search(ln))]
    last = stats[-STALL_STATS_LINES:]
    if len(last) < STALL_STATS_LINES:
        return None
    if not all(float(m["gen"]) == 0.0 and int(m["run"]) > 0 and float(m["kv"]) / 100 >= KV_FULL for m in last):
        return None
    m = last[-1]
    return (f"{m['run']} request(s) running, {m['wait']} waiting, KV cache {m['kv']}% full, generation "
            f"throughput 0.0 tokens/s on the last {len(last)} stats lines of the log")


_telling_line = telling_line   # the line a crash/OOM summary names (kvdiag.analyze.enginelog)


def banner_findings(e: EngineRecord) -> list[Finding]:
    out: list[Finding] = []
    for b in e.banners:
        risk = assess_risk_for(b, e.allocator)
        if risk.risky:  # one finding per reason, worded like the run's own banner findings so they merge
            out += [Finding(kind="banner_risk", engine=e.name, message=reason) for reason in risk.reasons]
    return out


def read_peers(proc: ProcessEvidence, verdict: Verdict) -> list[int]:
    """The processes a blocked-read verdict waits on: the peers of the connections of the thread it cites."""
    if verdict.kind is not VerdictKind.BLOCKED_IPC_READ or not verdict.evidence:
        return []
    tid = verdict.evidence[0].tid
    th = next((t for t in proc.threads if t.tid == tid), None)
    if th is None:
        return []
    return sorted({q for f in th.blocked_fds if f.kind in ("socket", "pipe") and not f.listening
                   for q in f.peer_pids if q != proc.pid})


class _PeerJudge:
    """Each captured process's own verdict, and who a blocked read really waits on.

    A read whose peer is another captured process that is itself hung (or stopped) is a
    consequence: an API server's loop waiting on its EngineCore, a client waiting on a server
    stuck in a GIL cycle. The verdict belongs to the process at the end of that chain. A chain
    that comes back to where it started is a real cross-process wait cycle and stands.
    """

    def __init__(self, bundle: Bundle, machine: str | None) -> None:
        self.machine = machine
        self.by_pid = {p.pid: p for p in bundle.processes}
        self.findings = bundle.findings
        self.engines = {e.name for e in bundle.engines}
        self._cache: dict[int, Verdict | None] = {}

    def verdict(self, pid: int) -> Verdict | None:
        if pid not in self._cache:
            p = self.by_pid[pid]
            self._cache[pid] = analyze_process(p, self.machine, p.engine) if judgeable([p], self.findings) else None
        return self._cache[pid]

    def hung_root(self, pid: int, seen: frozenset[int]) -> tuple[int, Verdict] | None:
        """(pid, verdict) of the hung process that ``pid``'s wait ends at; None if it is not hung or the
        chain of reads cycles back into ``seen``."""
        v = self.verdict(pid)
        if v is None or not (v.kind.is_hang or v.kind in _TARGET_STATES):
            return None
        for q in read_peers(self.by_pid[pid], v):
            if q in seen:
                return None
            if q in self.by_pid and (root := self.hung_root(q, seen | {pid})) is not None:
                return root
        return pid, v

    def defer(self, proc: ProcessEvidence, verdict: Verdict) -> tuple[int, Verdict] | None:
        """The hung peer ``proc``'s blocked read waits on, when one was captured."""
        for q in read_peers(proc, verdict):
            if q in self.by_pid and (root := self.hung_root(q, frozenset({proc.pid}))) is not None:
                return root
        return None

    def waits_on_own_engine(self, proc: ProcessEvidence, verdict: Verdict) -> list[int]:
        """The peers, when ``proc`` is a part of an engine (API server, EngineCore, worker) whose read
        waits only on other captured parts of the same engine and none of them is hung: an API server
        waiting for its engine's output, an EngineCore waiting for its next request. Not a hang."""
        if proc.role is ProcessRole.OTHER or not proc.engine:
            return []
        peers = read_peers(proc, verdict)
        mine = [q for q in peers if q in self.by_pid and self.by_pid[q].engine == proc.engine
                and self.by_pid[q].role is not ProcessRole.OTHER]
        if not peers or len(mine) != len(peers):
            return []
        if any(self.hung_root(q, frozenset({proc.pid})) is not None for q in mine):
            return []
        return mine


def _servers_were_paused_too(v: Verdict, proc: ProcessEvidence, bundle: Bundle, machine: str | None) -> Verdict:
    """A reply wait judged from stacks alone stands only if no other captured process waits for requests:
    such a process may be its server, paused by kvdiag's own tools at the instants the reader's stacks were
    taken (a request then sits unread and the client waits for its answer). Else: inconclusive."""
    servers = [p.pid for p in bundle.processes if p.pid != proc.pid and p.threads and any(
        t.read_role == "request" for t in classify_process(p, machine))]
    if not servers:
        return v
    who = ", ".join(f"pid {q}" for q in servers[:3])
    return v.model_copy(update={
        "kind": VerdictKind.INCONCLUSIVE,
        "confidence_reasons": [r for r in v.confidence_reasons if r != STACKS_ONLY] + [
            f"- {who} of this capture wait(s) for requests: possibly its server, paused by kvdiag's own tools "
            "while the reader's stacks were taken"],
        "summary": (f"inconclusive: {v.summary.removeprefix('blocked IPC read in ')}; but {who} of this capture "
                    "wait(s) for requests and may be its server, paused by kvdiag's own stack tools at the instants "
                    "the reader was sampled: without /proc's fd peers and sample window the wait cannot be told "
                    "from that")})


def _process_verdicts(procs: list[ProcessEvidence], machine: str | None, engine: str | None,
                      bundle: Bundle | None = None) -> tuple[list[Verdict], list[Finding]]:
    """Each process's verdict, worst first; a blocked read on a hung captured peer defers to the peer
    (it becomes a finding, the peer's own verdict is the cause)."""
    ordered = sorted(procs, key=lambda p: (p.role is not ProcessRole.ENGINE_CORE, p.role is ProcessRole.API_SERVER))
    judge = _PeerJudge(bundle, machine) if bundle is not None else None
    out: list[Verdict] = []
    deferred: list[Finding] = []
    adopted: set[int] = set()
    for p in ordered:
        v = analyze_process(p, machine, engine)
        if v is None:
            continue
        if STACKS_ONLY in v.confidence_reasons and bundle is not None:
            v = _servers_were_paused_too(v, p, bundle, machine)
        root = judge.defer(p, v) if judge is not None else None
        own = judge.waits_on_own_engine(p, v) if judge is not None and root is None else []
        if own:
            deferred.append(Finding(kind="waits_on_own_engine", pid=p.pid, engine=engine, message=(
                f"pid {p.pid} ({p.role.value}) waits on {', '.join(f'pid {q}' for q in own)} of its own engine, "
                f"whose stacks show no hang: waiting for its engine, not a deadlock. {v.summary}")))
            continue
        if root is None:
            out.append(v)
            continue
        q, qv = root
        assert judge is not None
        qp = judge.by_pid[q]
        whose = f" of engine {qp.engine}" if qp.engine and qp.engine != p.engine else ""
        # A hung peer no engine claims (captured without an engine record) is this engine's cause.
        if q not in {x.pid for x in procs} and qp.engine not in judge.engines and q not in adopted:
            adopted.add(q)
            out.append(qv.model_copy(deep=True, update={"engine": engine}))
        deferred.append(Finding(kind="waits_on_hung_peer", pid=p.pid, engine=engine, message=(
            f"pid {p.pid} waits on pid {q}{whose}, which is itself hung ({qv.kind.value}): a consequence, not the "
            f"cause. {v.summary}")))
    # stable: worst first, engine core first among equals
    return sorted(out, key=lambda v: severity(v.kind)), deferred


def _any_running(procs: list[ProcessEvidence], machine: str | None) -> bool:
    for p in procs:
        if any(t.running and not t.idle_by_design for t in classify_process(p, machine)):
            return True
    return False


_STARTING = (EnginePhase.LAUNCHING, EnginePhase.LOADING, EnginePhase.PROFILING, EnginePhase.KV_INIT,
             EnginePhase.BANNER)


def engine_verdict(name: str, e: EngineRecord | None, procs: list[ProcessEvidence], bundle: Bundle,
                   relevant: list[Finding]) -> Verdict:
    """Verdict for one engine (or one group of processes captured without an engine record)."""
    machine = bundle.host.get("machine")
    findings = (banner_findings(e) if e else []) + relevant
    findings += [f for p in procs for f in process_findings(p, machine, e.name if e else None)]
    pverdicts, deferred = _process_verdicts(judgeable(procs, relevant), machine, e.name if e else None, bundle)
    findings += deferred
    hang = pverdicts[0] if pverdicts else None

    def done(verdict: Verdict) -> Verdict:
        verdict.engine = e.name if e else verdict.engine
        seen = {(f.kind, f.message) for f in verdict.findings}
        verdict.findings += [f for f in findings if (f.kind, f.message) not in seen]
        if verdict.kind.is_hang and any(f.kind == "banner_risk" for f in findings):
            verdict.summary += "; the PageAllocator banner predicts it (see banner_risk)"
        return verdict

    if hang is not None and (moving := gpu_wait_progressed(name, hang, e)) is not None:
        return done(moving)   # a long kernel in a loop whose log still advances
    if e is not None:
        text = _engine_text(e)
        exited_badly = e.exit_code not in (None, 0) or (e.phase is EnginePhase.EXITED and e.exit_code != 0)
        if OOM_AT_EXIT.search(text) and (exited_badly or e.error):
            line = _telling_line(text, OOM_AT_EXIT)
            return done(Verdict(kind=VerdictKind.OOM, confidence=Confidence.HIGH,
                                summary=f"{name}: out of memory: {line.strip()[:200]}"))
        if exited_badly or (e.error and CRASH_AT_EXIT.search(e.error)):
            line = _telling_line(text, CRASH_AT_EXIT) or (e.error or "")
            code = f" with exit code {e.exit_code}" if e.exit_code is not None else ""
            # Without an exit code (a bare capture) the end of the log is the only witness.
            what = f"engine exited{code}" if exited_badly or e.phase is EnginePhase.EXITED else \
                "its log ends with a crash"
            return done(Verdict(kind=VerdictKind.CRASH, confidence=Confidence.HIGH if exited_badly else
                                Confidence.MEDIUM, summary=f"{name}: {what}: {line.strip()[:200]}".rstrip(": ")))
        stall = decode_stalled(e, bundle.metrics, bundle.stall_window_s or STALL_WINDOW_S)
        if stall is not None:
            if hang is not None:
                return done(Verdict(kind=VerdictKind.DECODE_STALL, confidence=hang.confidence,
                                    summary=f"{name}: decode stall: {stall}; mechanism: {hang.kind.value}: "
                                            f"{hang.summary}",
                                    evidence=hang.evidence, cycle=hang.cycle,
                                    findings=[Finding(kind="mechanism", engine=e.name, message=hang.kind.value)]))
            return done(Verdict(kind=VerdictKind.DECODE_STALL, confidence=Confidence.MEDIUM,
                                summary=f"{name}: decode stall: {stall}"))
        log_stall = decode_stalled_from_log(e)
        if log_stall is not None and (hang is None or hang.kind not in _TARGET_STATES):
            mech = f"; mechanism: {hang.kind.value}: {hang.summary}" if hang is not None else ""
            return done(Verdict(kind=VerdictKind.DECODE_STALL, confidence=Confidence.MEDIUM,
                                evidence=hang.evidence if hang is not None else [],
                                summary=f"{name}: decode stall: {log_stall}{mech}"))
    if hang is not None:
        return done(hang)
    outcome = evidence_outcome(name, procs, relevant, e.name if e else None)   # no evidence is not health
    if outcome is not None:
        if e is not None and e.phase is EnginePhase.STALLED:
            outcome.summary += f"; the engine had stalled in phase {e.phase.value}"
        return done(outcome)
    stalled = e is not None and (e.phase is EnginePhase.STALLED or (bundle.stall_detected and not e.healthy))
    if stalled and e is not None:
        if _any_running(procs, machine):
            return done(Verdict(kind=VerdictKind.SLOW_START, confidence=Confidence.MEDIUM,
                                summary=f"{name}: no log progress, but threads are still using CPU: slow, "
                                        "not deadlocked"))
        what = "no stacks were captured" if not procs else "the captured threads match no rule"
        return done(Verdict(kind=VerdictKind.UNKNOWN, confidence=Confidence.LOW,
                            summary=f"{name}: stalled in phase {e.phase.value}; {what}"))
    if e is not None and e.phase in _STARTING and not e.healthy:
        return done(starting_verdict(name, e))
    conf, reasons = healthy_confidence(e, procs, bundle)
    if procs:
        detail = "threads are running" if _any_running(procs, machine) else "threads are idle in normal waits"
        return done(Verdict(kind=VerdictKind.HEALTHY, confidence=conf, confidence_reasons=reasons,
                            summary=f"{name}: no hang evidence ({detail})"))
    state = "serving" if e is not None and (e.healthy or e.phase is EnginePhase.SERVING) else "no hang seen"
    return done(Verdict(kind=VerdictKind.HEALTHY, confidence=conf, confidence_reasons=reasons,
                        summary=f"{name}: {state}"))


def healthy_confidence(e: EngineRecord | None, procs: list[ProcessEvidence],
                       bundle: Bundle) -> tuple[Confidence, list[str]]:
    """How sure a healthy verdict is, from evidence alone, and why.

    Whether a thread happened to be on a CPU when it was sampled is timing noise (an idle
    engine and a busy one are equally healthy), so it never counts. What counts: the engine
    answered its probe, tokens kept flowing under load, and captured stacks that show no hang
    (lowered when a capture tool failed). Two independent witnesses: high; one: medium; none: low.
    """
    plus: list[str] = []
    minus: list[str] = []
    if e is not None and (e.healthy or e.phase is EnginePhase.SERVING):
        plus.append("the engine answered its readiness/health probe")
    soak = bundle.soak
    if soak is not None and not soak.stalled and soak.tokens > 0 and soak.requests_ok > 0:
        plus.append(f"tokens kept flowing under load ({soak.tokens} tokens, {soak.requests_ok} requests)")
    if procs:
        failed = sorted({t.tool for p in procs for t in p.tools if not t.ok})
        if failed and not any(t.ok and t.tool != "proc" for p in procs for t in p.tools):
            minus.append(f"no stack tool succeeded ({', '.join(failed)})")
        else:
            plus.append(f"the stacks of {len(procs)} captured process(es) show no hang pattern")
    else:
        minus.append("no stacks were captured")
    if e is None and not procs:
        minus.append("no engine record and no probe")
    level = len(plus)
    conf = Confidence.HIGH if level >= 2 else Confidence.MEDIUM if level == 1 else Confidence.LOW
    return conf, [f"+ {r}" for r in plus] + [f"- {r}" for r in minus]
