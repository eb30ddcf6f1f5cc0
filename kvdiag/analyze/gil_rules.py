"""The GIL rules: a GIL cycle (a thread holds the GIL while it waits on work that needs the GIL),
and a GIL held across a blocking wait.
"""

from __future__ import annotations

from kvdiag.analyze.classify import ThreadView, WaitKind
from kvdiag.analyze.evidence import GIL_WAITER_KEYS, HOLDER_KEYS, cite, where
from kvdiag.analyze.rulekit import (
    HOLDER_BLOCKED,
    WAIT_WORDS,
    cited,
    has_frame,
    holder_role,
    infer_holder,
    onode,
    outside_peer,
    peer_phrase,
    pick_holder,
    place,
    released_gil,
    tnode,
    waiter_role,
)
from kvdiag.analyze.waitgraph import WaitGraph
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.run import Finding
from kvdiag.model.verdict import Verdict


def _gil_waiters(views: list[ThreadView], holder: ThreadView) -> list[ThreadView]:
    return [t for t in views if t.kind is WaitKind.GIL_WAIT and t.tid != holder.tid]


def gil_held_blocked(proc: ProcessEvidence, views: list[ThreadView]) -> tuple[ThreadView, str] | None:
    """(holder, how long) when a thread holds the GIL across a blocking call for the whole sample window."""
    holder = pick_holder(views)
    if holder is None or holder.running or holder.woke or released_gil(holder):
        return None
    if holder.kind not in HOLDER_BLOCKED | {WaitKind.SLEEP, WaitKind.EVENT_WAIT} or holder.kind is WaitKind.GIL_WAIT:
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
    block = WAIT_WORDS.get(holder.kind, {WaitKind.SLEEP: "sleeping", WaitKind.EVENT_WAIT: "polling"}.get(
        holder.kind, "blocked"))
    peer = "".join(f"; reading {peer_phrase(f)}" for f in holder.blocked_fds[:1]) if holder.blocked_fds else ""
    conf = Confidence.HIGH if any(s in ("pystack", "proc") for s in holder.gil_holder_sources) else Confidence.MEDIUM
    evidence = [cited(holder, f"holds the GIL while {block} ({how}){peer}", engine, HOLDER_KEYS)]
    evidence += [cited(w, waiter_role(w) + f" [{'; '.join(w.gil_wait_signals)}]", engine, GIL_WAITER_KEYS)
                 for w in waiters[:4]]
    names = ", ".join(w.label for w in waiters[:3]) + (f" and {len(waiters) - 3} more" if len(waiters) > 3 else "")
    return Verdict(kind=VerdictKind.GIL_HELD_BLOCKED, confidence=conf, engine=engine, evidence=evidence,
                   summary=(f"GIL held while blocked in {place(proc)}: {holder.label} holds the GIL while {block}"
                            f"{where(holder)} ({how}){peer}; {len(waiters)} Python thread(s) wait for it: {names}. "
                            f"No line of Python runs until that call returns"))


def gil_held_warning(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Finding | None:
    """The same shape without waiters: not a stall yet, but the next thread that wants the GIL stalls."""
    found = gil_held_blocked(proc, views)
    if found is None or _gil_waiters(views, found[0]):
        return None
    holder, how = found
    block = WAIT_WORDS.get(holder.kind, {WaitKind.SLEEP: "sleeping"}.get(holder.kind, "blocked"))
    return Finding(kind="gil_held_blocked", pid=proc.pid, engine=engine, message=(
        f"{holder.label} holds the GIL while {block}{where(holder)} ({how}); no other thread wants it yet, but "
        f"until that call returns no line of Python can run in {place(proc)}: the first request, callback or "
        f"timer that needs the interpreter will stall behind it. Release the GIL around blocking calls "
        f"(Py_BEGIN_ALLOW_THREADS, py::gil_scoped_release, nb::gil_scoped_release). Holder's frames: "
        f"{' ← '.join(cite(holder, 8)) or 'none read'}"))


def rule_gil_cycle(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    waiters = [t for t in views if t.kind is WaitKind.GIL_WAIT]
    if not waiters:
        return None
    holder = pick_holder(views)
    inferred = False
    if holder is None:
        holder = infer_holder(views)
        inferred = holder is not None
    if (holder is None or holder.running or holder.timed or holder.woke or holder.kind not in HOLDER_BLOCKED
            or released_gil(holder)):
        return None   # a timed wait ends by itself: GIL-heavy, not a cycle
    if holder.kind is WaitKind.IO_READ and outside_peer(holder, proc.pid):
        return None   # the read ends when another process writes: no thread of ours needs to run
    waiters = [w for w in waiters if w.tid != holder.tid]
    if not waiters:
        return None
    g = WaitGraph()
    gil = g.node(f"GIL{proc.pid}", f"the GIL of pid {proc.pid}")
    h = tnode(g, holder, f"holds the GIL, {WAIT_WORDS.get(holder.kind, 'blocked')}{where(holder, 1)}")
    g.edge(gil, h, "held by")
    for w in waiters:
        g.edge(tnode(g, w, f"waits for the GIL{where(w, 1)}"), gil, "waits for")
    obj = onode(g, holder)
    g.edge(h, obj, "waits on")
    by_tid = {t.tid: t for t in views}
    if holder.kind is WaitKind.MUTEX_WAIT and holder.owner_tid in by_tid:
        g.edge(obj, tnode(g, by_tid[holder.owner_tid]), "owned by")
    else:
        # Nobody else can run: the object can only be released by a thread that first needs the GIL.
        for w in waiters:
            if not w.idle_by_design:
                g.edge(obj, tnode(g, w), "can only be signalled by", inferred=True)
    cycles = [c for c in g.cycles() if gil in c]
    if not cycles:
        return None
    # The waiter that can wake the holder first: it runs in the holder's native library (the prealloc
    # worker in map_pages), not a Python thread that merely queues for the GIL (process_output_sockets
    # in queue.get). The cycle drawn and cited is the one through that waiter, not the first found.
    best = sorted(waiters, key=lambda w: (
        not (w.libraries & holder.libraries), not has_frame(w, "map_pages"), any(f.kind == "python" for f in
                                                                                   w.frames), w.tid))
    nodes = [tnode(g, w) for w in best]
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
    summary = (f"GIL cycle in {place(proc)}: {holder.label} holds the GIL while "
               f"{WAIT_WORDS.get(holder.kind, 'blocked')}{where(holder)}; {main_waiter.label} waits for the "
               f"GIL{where(main_waiter)}{more}{how}")
    # The holder rests on its blocking call, its project frame and the Python call that entered it; a
    # waiter on its GIL acquire and the project code that wants the GIL (map_pages, the callback).
    evidence = [cited(holder, holder_role(holder), engine, HOLDER_KEYS)]
    evidence += [cited(w, waiter_role(w) + f" [{'; '.join(w.gil_wait_signals)}]", engine, GIL_WAITER_KEYS)
                 for w in ranked[:4]]
    return Verdict(kind=VerdictKind.GIL_CYCLE, summary=summary, confidence=conf, evidence=evidence,
                   engine=engine, cycle=g.describe_cycle(cycle))
