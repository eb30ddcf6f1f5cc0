"""The lock rules: lock-order inversion (native and Python locks), lost wakeup, a process where
nothing can move, and waiters stuck without a known holder.
"""

from __future__ import annotations

import re

from kvdiag.analyze import vocab as v
from kvdiag.analyze.classify import ThreadView, WaitKind
from kvdiag.analyze.evidence import BLOCKED_KEYS, CONTEXT_KEYS, GIL_WAITER_KEYS, where
from kvdiag.analyze.outcome import idle_new_work
from kvdiag.analyze.rulekit import (
    HOLDER_BLOCKED,
    WAIT_WORDS,
    cited,
    onode,
    pick_holder,
    place,
    possible_signallers,
    tnode,
    user_lock_frame,
    waiter_role,
)
from kvdiag.analyze.runtime import may_release_python_lock
from kvdiag.analyze.waitgraph import WaitGraph
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.verdict import Verdict

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
               and user_lock_frame(t) is not None]
    addrs = {t.wait_addr for t in waiters if t.wait_addr}
    if len(waiters) < 2 or (addrs and len(addrs) < 2):
        return None
    # Only a thread that can run Python releases a Python lock (kvdiag.analyze.runtime: a runtime's native threads).
    # A thread idle on new work (accept, a poll, a timer loop) that did not advance over an observed window is not
    # acting: it could hold one of the locks only if it took it before it went idle (pystack --locals decides).
    idle = idle_new_work(proc)
    signallers = [t for t in possible_signallers(views, waiters, proc) if t.tid not in idle]
    if any(may_release_python_lock(t, waiters) for t in signallers) or any(
            t.kind is WaitKind.GIL_WAIT for t in views):
        return None
    ring = _lock_reference_cycle(waiters, views)
    if ring:
        g = WaitGraph()
        for t, want, has in ring:
            tnode(g, t, f"holds lock {has:#x} (referenced in its frames), waits for lock {want:#x}{where(t, 1)}")
        for t, want, _ in ring:
            owner = next(u for u, _, has in ring if has == want)
            obj = g.node(f"PYLOCK{proc.pid}:{want:x}", f"Python lock {want:#x}")
            g.edge(tnode(g, t), obj, "waits for")
            g.edge(obj, tnode(g, owner), "held by (inferred from references)", inferred=True)
        cycle = min(g.cycles(), key=len) if g.cycles() else []
        desc = "; ".join(f"{t.label} holds lock {has:#x} and waits for {want:#x}{where(t, 1)}" for t, want, has in ring)
        evidence = [cited(t, f"waits for Python lock {want:#x}; holds {has:#x} (its frames reference it and it "
                             "does not wait for it)", engine, BLOCKED_KEYS) for t, want, has in ring[:4]]
        return Verdict(kind=VerdictKind.LOCK_ORDER_INVERSION, confidence=Confidence.MEDIUM, engine=engine,
                       evidence=evidence, cycle=g.describe_cycle(cycle) if cycle else [],
                       confidence_reasons=["+ each lock's holder named by its references (pystack --locals, lock "
                                           "objects only)", "- Python locks record no owner: holding is inferred "
                                           "from references, not read"],
                       summary=(f"lock-order inversion between Python locks in {place(proc)}: {desc}. Python locks "
                                f"record no owner; each holder is the one other thread whose frames reference the "
                                f"lock without waiting for it (pystack --locals), and no other thread can run"))
    lines = []
    for t in waiters:
        i = user_lock_frame(t)
        f = t.frames[i] if i is not None else None
        at = f" at {v.describe(f)}" + (f" `{f.source.strip()}`" if f is not None and f.source else "") if f else ""
        lines.append((t, at))
    conf = Confidence.MEDIUM if len(addrs) == len(waiters) else Confidence.LOW
    desc = "; ".join(f"{t.label} waits for a lock{at}" for t, at in lines)
    evidence = [cited(t, f"waits for Python lock {t.wait_addr:#x}" if t.wait_addr else "waits for a Python lock",
                      engine, BLOCKED_KEYS) for t in waiters[:4]]
    return Verdict(kind=VerdictKind.LOCK_ORDER_INVERSION, confidence=conf, engine=engine, evidence=evidence,
                   summary=(f"likely lock-order inversion between Python locks in {place(proc)}: {desc}. "
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
        tnode(g, t, f"{holds}waits for mutex {t.wait_addr:#x}" if t.wait_addr else "")
    for t in waiters:
        obj = onode(g, t)
        g.edge(tnode(g, t), obj, "waits for")
        if t.owner_tid in by_tid:
            g.edge(obj, tnode(g, by_tid[t.owner_tid]), "owned by")
    cycles = g.cycles()
    if cycles:
        cycle = min(cycles, key=len)
        members = [t for t in waiters if tnode(g, t) in cycle]
        from_frames = all(m.wait_frame and not m.wait_frame.startswith(("wchan", "syscall")) for m in members)
        conf = Confidence.HIGH if from_frames else Confidence.MEDIUM
        desc = "; ".join(f"{m.label} holds mutex {', '.join(held.get(m.tid, ['?']))} and waits for "
                         f"{m.wait_addr:#x}{where(m, 1)}" for m in members if m.wait_addr)
        evidence = [cited(m, f"holds mutex {', '.join(held.get(m.tid, ['?']))}, waits for mutex "
                             f"{m.wait_addr:#x}" if m.wait_addr else "waits for a mutex", engine, BLOCKED_KEYS)
                    for m in members]
        return Verdict(kind=VerdictKind.LOCK_ORDER_INVERSION, confidence=conf, engine=engine,
                       summary=f"lock-order inversion in {place(proc)}: {desc}", evidence=evidence,
                       cycle=g.describe_cycle(cycle))
    owners_known = any(t.owner_tid is not None for t in waiters)
    addrs = {t.wait_addr for t in waiters if t.wait_addr}
    # Without /proc there are no addresses at all: two untimed mutex waits from frames, with no
    # thread left that could release anything, still cannot end (low confidence).
    unread = not addrs and all(t.wait_addr is None for t in waiters) and not possible_signallers(views, waiters)
    if not owners_known and (len(addrs) >= 2 or unread) and not any(t.running and not t.idle_by_design
                                                                     for t in views):
        evidence = [cited(t, f"waits for mutex {t.wait_addr:#x} (owner unknown)" if t.wait_addr else
                          "waits for a mutex (owner unknown)", engine, BLOCKED_KEYS) for t in waiters[:4]]
        return Verdict(kind=VerdictKind.LOCK_ORDER_INVERSION, confidence=Confidence.LOW, engine=engine,
                       summary=(f"likely lock-order inversion in {place(proc)}: {len(waiters)} threads wait on "
                                f"{f'{len(addrs)} different mutexes' if addrs else 'mutexes'}"
                                f"{''.join(where(t, 1) for t in waiters[:1])} and nothing runs "
                                f"(owners could not be read)"),
                       evidence=evidence)
    return rule_python_lock_inversion(proc, views, engine)


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
    if possible_signallers(views, [w for w in waiters if not w.is_main], proc):
        return None
    # The application's waiter first (a thread with Python frames: it waits for an outcome), before a native
    # library's own threads parked between jobs; then worker threads before the main thread.
    waiters.sort(key=lambda t: (not any(f.kind == "python" for f in t.frames), t.is_main, t.tid))
    native = [t for t in waiters if t.kind is WaitKind.COND_WAIT]
    first = (native or waiters)[0]
    if native:
        conf = Confidence.HIGH
    elif any(t.kind is WaitKind.PY_LOCK_WAIT for t in waiters):
        conf = Confidence.MEDIUM
    else:
        conf = Confidence.LOW
    evidence = [cited(t, f"waits on {'condition variable' if t.kind is WaitKind.COND_WAIT else 'a futex'}"
                         f"{f' {t.wait_addr:#x}' if t.wait_addr else ''} that no live thread will signal", engine,
                      BLOCKED_KEYS)
                for t in (native or waiters)[:3]]
    evidence += [cited(t, f"also blocked ({WAIT_WORDS.get(t.kind, t.kind.value)})", engine, CONTEXT_KEYS)
                 for t in live if t not in waiters and t.kind in HOLDER_BLOCKED][:3]
    return Verdict(kind=VerdictKind.LOST_WAKEUP, confidence=conf, engine=engine, evidence=evidence,
                   summary=(f"lost wakeup in {place(proc)}: {first.label} waits on a condition variable"
                            f"{where(first)}; every other thread is blocked too, so nobody can signal it"))


def rule_stuck_unknown(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    if proc.progress is not None and (proc.progress.advanced or len(set(proc.progress.gil_holders)) > 1):
        return None   # it did I/O, or the GIL changed hands during the window
    if any(t.woke for t in views):
        return None   # a thread that woke may be the holder we could not name
    waiters = [t for t in views if t.kind is WaitKind.GIL_WAIT]
    if waiters and not any(t.running for t in views):
        holder = pick_holder(views)
        if holder is not None and holder.timed:
            return None   # the holder's wait times out: the GIL will move
        what = (f"{holder.label} holds it but shows no wait we can name" if holder is not None
                else "the GIL holder could not be identified")
        evidence = ([cited(holder, "GIL holder", engine, BLOCKED_KEYS)] if holder is not None else [])
        evidence += [cited(w, waiter_role(w), engine, GIL_WAITER_KEYS) for w in waiters[:4]]
        return Verdict(kind=VerdictKind.UNKNOWN, confidence=Confidence.LOW, engine=engine, evidence=evidence,
                       summary=f"{place(proc)}: {len(waiters)} thread(s) wait for the GIL and nothing runs; {what}")
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
    if possible_signallers(views, [], proc):
        return None
    if not any(t.has_frames or t.wait_addr for t in live):
        return None      # the kernel's view alone cannot tell a lock from an idle futex
    live.sort(key=lambda t: (t.is_main, user_lock_frame(t) is None, t.tid))   # the application's own wait first
    self_held = [t for t in live if t.kind is WaitKind.MUTEX_WAIT and t.wait_addr and t.owner_tid is None
                 and len(live) == 1]
    what = (f"{live[0].label} waits for a lock that only it could release" if len(live) == 1 else
            f"all {len(live)} threads wait, with no timeout, on locks, condition variables or joins that only "
            f"another of them could release")
    evidence = [cited(t, f"{WAIT_WORDS.get(t.kind, 'blocked')} (no timeout, no wakeup)", engine, BLOCKED_KEYS)
                for t in live[:4]]
    return Verdict(kind=VerdictKind.UNKNOWN, confidence=Confidence.MEDIUM if not self_held else Confidence.LOW,
                   engine=engine, evidence=evidence,
                   summary=(f"pid {proc.pid} cannot make progress: {what}{where(live[0])}; no thread runs, woke, "
                            f"waits with a timeout or for the outside world, and no signal handler could end "
                            f"a wait"))
