"""The cross-process verdict: which chain of the wait-for graph (kvdiag.analyze.xproc) ends in a hang,
how its end is worded, and how that verdict meets the per-process one.

The verdict's kind is the root's kind; a reply nobody produces (the chain ends at processes parked
waiting for work) is a lost message across processes; a cycle of IPC waits is a cross-process wait cycle.

Pure: reads the graph only.
"""

from __future__ import annotations

from kvdiag.analyze import vocab as v
from kvdiag.analyze.classify import WaitKind
from kvdiag.analyze.evidence import BLOCKED_KEYS, CONTEXT_KEYS, cite_item, where
from kvdiag.analyze.tcp_match import fmt, split_connection
from kvdiag.analyze.xproc import Chain, CrossProcess, Dep, pkey
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.verdict import EvidenceItem, Verdict
from kvdiag.model.waits import EdgeKind, WaitChain, WaitGraphRecord

# How each kind of edge reads in the chain's text.
_WORDS = {
    EdgeKind.SOCKET_READ: "waits on a socket for", EdgeKind.PIPE_READ: "waits on a pipe for",
    EdgeKind.MQUEUE_READ: "waits on a message queue for",
    EdgeKind.SOCKET_WRITE_FULL: "is blocked writing a full socket to", EdgeKind.PIPE_WRITE_FULL:
        "is blocked writing a full pipe only drained by", EdgeKind.CHILD_WAIT: "waits (wait4) for its child",
    EdgeKind.SHARED_FUTEX: "waits on a shared futex that only another mapper can post:",
    EdgeKind.SHM_RING: "spins on a shared-memory ring that only another mapper advances:",
    EdgeKind.ZMQ: "waits on ZMQ for", EdgeKind.RAY_GET: "waits (ray.get) for",
}


# A TCP hop to another host: (any wait, a reply awaited).
_TCP_WORDS = {EdgeKind.SOCKET_READ: ("waits on a connection to", "waits for a reply from"),
              EdgeKind.SOCKET_WRITE_FULL: ("is blocked sending to", "is blocked sending to"),
              EdgeKind.ZMQ: ("waits on ZMQ over a connection to", "waits on ZMQ for a reply from")}


def _hang_of(chain: Chain) -> tuple[VerdictKind, str] | None:
    """The chain's verdict kind and how its end is worded; None when the chain ends where nothing is stuck."""
    purposes = {d.purpose for d in chain.deps}
    if chain.cycle:
        if purposes & {"reply", "blocked"}:
            return VerdictKind.BLOCKED_IPC_READ, "cross-process wait cycle"
        return None
    root = chain.root
    if root is None:
        return None
    if root.state in ("hung", "stopped") and root.verdict is not None:
        return root.verdict.kind, root.state
    if root.state == "blocked" and purposes & {"reply", "blocked"} and root.view is not None:
        kind = VerdictKind.LOST_WAKEUP if root.view.kind in (WaitKind.COND_WAIT, WaitKind.PY_LOCK_WAIT) and (
            root.view.kind is WaitKind.COND_WAIT or root.view.py_wait == "py_cond") else VerdictKind.UNKNOWN
        return kind, "blocked"
    if root.state == "parked" and purposes & {"reply", "blocked"}:
        return VerdictKind.BLOCKED_IPC_READ, "lost message"
    if root.state == "not_captured" and chain.deps[-1].purpose in ("reply", "blocked"):
        return VerdictKind.BLOCKED_IPC_READ, "peer not captured"
    return None


_RANK = {"hung": 0, "stopped": 1, "blocked": 2, "cross-process wait cycle": 3, "lost message": 4,
         "peer not captured": 6}


def judge_across(bundle: Bundle) -> tuple[Verdict | None, WaitGraphRecord]:
    """The cross-process verdict of ``bundle`` (None: no chain ends in a hang) and the whole graph."""
    g = CrossProcess(bundle)
    return judge_graph(g), g.record()


def judge_graph(g: CrossProcess) -> Verdict | None:
    """The verdict of the worst chain of ``g`` that ends in a hang; None when none does."""
    if not g.deps:
        return None
    judged = [(c, h) for c in g.chains() if (h := _hang_of(c)) is not None]
    if not judged:
        return None
    chain, (kind, how) = sorted(judged, key=lambda ch: (_RANK.get(ch[1][1], 5), -len(ch[0].deps)))[0]
    return _verdict(g, chain, kind, how)


def _step(g: CrossProcess, d: Dep) -> str:
    src = g.label(pkey(d.edge.src), d.edge.src.tid)
    dst = g.label(pkey(d.edge.dst))
    view = next((t for t in g.views.get(pkey(d.edge.src), []) if t.tid == d.edge.src.tid), None)
    ends = split_connection(d.edge.evidence.address)
    if d.edge.src.node != d.edge.dst.node and ends is not None and d.edge.kind in _TCP_WORDS:
        # A connection to another host: its address first, then who holds the other end there.
        verb = _TCP_WORDS[d.edge.kind][d.purpose == "reply"]
        if d.edge.kind is EdgeKind.ZMQ and d.purpose == "blocked":
            verb = "is blocked sending on ZMQ (queue full) to"
        return (f"{src}{where(view) if view is not None else ''} {verb} {fmt(ends[1])} "
                f"({fmt(ends[0])} -> {fmt(ends[1])}), whose other end {dst} holds")
    text = f"{src}{where(view) if view is not None else ''} {_WORDS.get(d.edge.kind, 'waits for')} {dst}"
    if d.edge.kind is EdgeKind.ZMQ and d.purpose in ("reply", "blocked"):
        text += " (a reply)" if d.purpose == "reply" else " (send blocked, queue full)"
    return text


def _place(item: EvidenceItem | None) -> str:
    """`` in zmq_poll ← poll ← server``: the frames the root's citation rests on (its key frames)."""
    if item is None or not item.key_frames:
        return ""
    names = [v.short_name(item.frames[k].split(" (")[0], components=2).removesuffix("()") for k in item.key_frames
             if k < len(item.frames)]
    names = [n for n in names if n.strip()]   # a frame with no name would leave a dangling arrow
    return f" in {' ← '.join(dict.fromkeys(names))}" if names else ""


def _root_text(g: CrossProcess, chain: Chain, how: str, item: EvidenceItem | None) -> str:
    root = chain.root
    if chain.cycle:
        return "and so back to the start: each waits on the next, nobody moves"
    assert root is not None
    who = g.label(root.key, root.view.tid if root.view else None)
    at = f" ({_place(item).strip()})" if _place(item) else ""
    if how == "lost message":
        return (f"{who} is parked waiting for work{at}: the message was lost between processes (every process "
                f"waits for work while one waits for a reply nobody produces)")
    if how == "peer not captured":
        why = next((p.why_not for ev in g.bundle.processes for p in ev.peers_outside
                    if (p.node, p.pid) == root.key and p.why_not), None)
        why = why or "outside the captured tree; capture it with --pid, or let capture follow edges"
        return f"{who} was not captured ({why}): the wait has no timeout and nothing of the waiting process runs"
    if how in ("hung", "stopped") and root.verdict is not None:
        return f"{who} is {root.verdict.kind.value}: {root.verdict.summary}"
    frame = root.view.wait_frame if root.view else None
    return (f"{who} is blocked in {frame or 'a lock/condition wait'}{_place(item)} with no timeout, and no "
            f"thread of its process that could wake it runs")


def _at(item: EvidenceItem, node: str | None) -> EvidenceItem:
    """``item`` naming the host its process ran on (a merged bundle's pids repeat across hosts)."""
    if node is not None:
        item.node = item.node or node
        for ref in item.refs:
            ref.node = ref.node or node
    return item


def _verdict(g: CrossProcess, chain: Chain, kind: VerdictKind, how: str) -> Verdict:
    evidence: list[EvidenceItem] = []
    root = chain.root
    if root is not None and root.verdict is not None and how in ("hung", "stopped"):
        evidence += [_at(e.model_copy(deep=True, update={"role": f"root: {e.role}"}), root.key[0])
                     for e in root.verdict.evidence]
    elif root is not None and root.view is not None:
        evidence.append(_at(cite_item(root.view, f"root ({how}): {root.view.kind.value}", g.procs[root.key].engine,
                                      BLOCKED_KEYS), root.key[0]))
    steps = "; ".join(_step(g, d) for d in chain.deps)
    summary = f"{'request stuck across processes' if how != 'cross-process wait cycle' else how}: {steps}; "
    summary += _root_text(g, chain, how, evidence[0] if evidence and root is not None else None)
    for d in chain.deps:
        view = next((t for t in g.views.get(pkey(d.edge.src), []) if t.tid == d.edge.src.tid), None)
        if view is not None and not any(e.pid == view.pid and e.tid == view.tid and e.node == d.edge.src.node
                                        for e in evidence):
            keys = BLOCKED_KEYS if chain.cycle else CONTEXT_KEYS
            evidence.append(_at(cite_item(view, f"{d.edge.kind.value} ({d.purpose}): {_step(g, d)}",
                                          g.procs[pkey(d.edge.src)].engine, keys), d.edge.src.node))
    labels = {d.edge.src.key(): g.label(pkey(d.edge.src), d.edge.src.tid) for d in chain.deps}
    labels |= {d.edge.dst.key(): g.label(pkey(d.edge.dst)) for d in chain.deps}
    rootref = None
    if root is not None:
        rootref = g.ref(root.key, root.view.tid if root.view else None)
        labels[rootref.key()] = g.label(root.key, rootref.tid)
    waits = WaitChain(edges=[d.edge for d in chain.deps], root=rootref, root_state=root.state if root else "cycle",
                      cycle=chain.cycle, lost_message=how == "lost message", labels=labels)
    if root is not None and evidence and (evidence[0].node, evidence[0].pid) == root.key:
        waits.root_role, waits.root_frames = evidence[0].role, list(evidence[0].frames)
        waits.root_key_frames = list(evidence[0].key_frames or [])
        waits.root_refs = [r.model_copy() for r in evidence[0].refs]
    inferred = any(d.edge.inferred for d in chain.deps)
    conf = Confidence.MEDIUM if inferred or how == "lost message" else Confidence.HIGH
    if how == "peer not captured":
        conf = Confidence.LOW
    if root is not None and root.verdict is not None and root.verdict.confidence is Confidence.LOW:
        conf = Confidence.LOW
    reasons = [f"+ {len(chain.deps)} wait edge(s) across processes, each from /proc (fd peers, syscall "
               "arguments, shared mappings)"]
    if inferred:
        reasons.append("- an edge rests on a possibility (any mapper of a shared file, any holder of a pipe end)")
    cycle = [labels.get(d.edge.src.key(), d.edge.src.key()) for d in chain.deps] if chain.cycle else []
    return Verdict(kind=kind, summary=summary, confidence=conf, evidence=evidence, waits=waits, cycle=cycle,
                   confidence_reasons=reasons)


def merge_across(overall: Verdict, cross: Verdict | None) -> Verdict:
    """The overall verdict once the processes are judged as a whole: a capture whose processes look
    healthy (or undecided) one by one takes the chain's verdict; a hang already named keeps its kind and
    gains the chain when the chain ends at the process it names."""
    if cross is None:
        return overall
    if overall.kind in (VerdictKind.HEALTHY, VerdictKind.INCONCLUSIVE):
        out = cross.model_copy(deep=True)
        out.engine = overall.engine
        out.findings += overall.findings
        return out
    cited = {e.pid for e in overall.evidence}
    on_chain = {n.pid for n in cross.waits.nodes()} if cross.waits is not None else set()
    if cross.kind is overall.kind and cited & on_chain and overall.waits is None:
        # The process-level verdict stays (its words and citations); the chain and its root are added.
        out = overall.model_copy(deep=True)
        out.waits = cross.waits
        # The root's own sentence is already the summary's first: the chain says only who waits on it.
        chain = cross.summary
        marker = f" is {overall.kind.value}: "
        before, _, root = chain.partition(marker)
        if root and overall.summary.startswith(root.rstrip(".")):
            chain = f"{before} is {overall.kind.value} (above)"
        out.summary = f"{overall.summary}; across processes, {chain}"
        out.cycle = out.cycle or cross.cycle
        return out
    return overall
