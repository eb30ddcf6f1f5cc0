"""One analysis over a bundle merged from several hosts (fleet capture, ``kvdiag merge``). Pure.

A pid is unique only within its node: each node's processes are judged as the bundle of that node
alone (the per-process rules and the peer judge key everything by pid), and the verdicts are named
``<node>/<group>``. Across nodes, the waits a single host cannot see are joined here:
- a worker blocked in ``ray.get`` waits on the task it submitted, run by a process that Ray's task
  table names on another node (a task's ``parent_task_id`` is the task that submitted it);
- a thread blocked reading a TCP connection waits on the process that holds the other end, found on
  another node by address and port (the connection's two endpoints, swapped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvdiag.analyze.classify import ThreadView, WaitKind, classify_process
from kvdiag.analyze.evidence import CONTEXT_KEYS, cite_item
from kvdiag.analyze.process import analyze_process
from kvdiag.analyze.rulekit import severity
from kvdiag.analyze.tcp_match import TcpIndex, split_connection
from kvdiag.analyze.xproc import CrossProcess
from kvdiag.analyze.xverdict import judge_graph
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.fleet import RayActorRecord, RayTaskRecord
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.run import Finding
from kvdiag.model.verdict import EvidenceItem, Verdict
from kvdiag.model.waits import EdgeEvidence, EdgeKind, FrameRef, NodeRef, WaitChain, WaitEdge

# Where a Ray worker blocks for an object: ray.get (and the get_objects it calls) in Ray's worker module.
_RAY_GET_FILES = ("ray/_private/worker.py",)
_RAY_GET_FUNCS = ("get", "get_objects")


def node_names(bundle: Bundle) -> list[str]:
    """The nodes of a merged bundle, in order of first appearance; [] for a single-host bundle."""
    seen: dict[str, None] = {}
    for p in bundle.processes:
        if p.node:
            seen.setdefault(p.node, None)
    return list(seen)


def is_merged(bundle: Bundle) -> bool:
    return bundle.fleet is not None or bool(node_names(bundle))


def node_bundles(bundle: Bundle) -> list[tuple[str, Bundle]]:
    """Each node's part of a merged bundle, as a bundle of its own (engines, findings and processes)."""
    out: list[tuple[str, Bundle]] = []
    for node in node_names(bundle):
        procs = [p for p in bundle.processes if p.node == node]
        engines = {p.engine for p in procs if p.engine}
        out.append((node, bundle.model_copy(update={
            "processes": procs, "engines": [e for e in bundle.engines if e.name in engines],
            "findings": [f for f in bundle.findings if f.node == node], "fleet": None})))
    return out


def on_node(verdict: Verdict, node: str) -> Verdict:
    """``verdict`` (judged on ``node``'s bundle alone) with its evidence, findings and wait chain naming the node."""
    for item in verdict.evidence:
        item.node = item.node or node
        for ref in item.refs:
            ref.node = ref.node or node
    for f in verdict.findings:
        if f.pid is not None:
            f.node = f.node or node
    chain = verdict.waits
    if chain is not None:
        nodes = [r for e in chain.edges for r in (e.src, e.dst)] + ([chain.root] if chain.root else [])
        for at in nodes:
            at.node = at.node or node
        for fr in [f for e in chain.edges for f in e.evidence.frames] + chain.root_refs:
            fr.node = fr.node or node
        chain.labels = {k if k.startswith(f"{node}/") else f"{node}/{k}": lab for k, lab in chain.labels.items()}
    return verdict


def by_node(bundle: Bundle, judge: Callable[[Bundle], dict[str, Verdict]]) -> dict[str, Verdict]:
    """The per-group verdicts of every node (``judge`` is the single-host analysis), named ``node/group``."""
    out: dict[str, Verdict] = {}
    for node, sub in node_bundles(bundle):
        for name, verdict in judge(sub).items():
            out[name if name.startswith(f"{node}/") else f"{node}/{name}"] = on_node(verdict, node)
    return out


@dataclass
class CrossNodeWait:
    """A thread on one node waits on a process on another."""

    waiter: ProcessEvidence
    thread: ThreadView
    target_node: str
    target_pid: int
    how: str                         # "ray.get of task B.work", "TCP read 10.0.0.2:5000"
    target: ProcessEvidence | None = None


def _ray_get_thread(proc: ProcessEvidence, machine: str | None) -> ThreadView | None:
    for t in classify_process(proc, machine):
        if t.running:
            continue
        if any(f.kind == "python" and f.name in _RAY_GET_FUNCS and (f.file or "").endswith(_RAY_GET_FILES)
               for f in t.frames):
            return t
    return None


def ray_get_waits(bundle: Bundle) -> list[CrossNodeWait]:
    """Workers blocked in ``ray.get`` on a task that runs (or is queued) on another captured process."""
    fleet = bundle.fleet
    if fleet is None or not fleet.tasks:
        return []
    machine = bundle.host.machine
    tasks = {t.task_id: t for t in fleet.tasks}
    actors = {a.actor_id: a for a in fleet.actors}
    procs: dict[tuple[str | None, int], ProcessEvidence] = {(p.node, p.pid): p for p in bundle.processes if p.node}
    out: list[CrossNodeWait] = []
    seen: set[tuple[str | None, int, str | None, int]] = set()
    for task in fleet.tasks:
        parent = tasks.get(task.parent_task_id or "")
        if parent is None or parent.state != "RUNNING" or parent.worker_pid is None:
            continue
        waiter = procs.get((parent.node, parent.worker_pid))
        where = _runs_at(task, actors)
        if waiter is None or where is None or where == (parent.node, parent.worker_pid):
            continue
        thread = _ray_get_thread(waiter, machine)
        if thread is None:
            continue      # it submitted the task but does not block on it now
        key = (waiter.node, waiter.pid, where[0], where[1])
        if key in seen:
            continue
        seen.add(key)
        out.append(CrossNodeWait(waiter=waiter, thread=thread, target_node=where[0] or "?", target_pid=where[1],
                                 how=f"ray.get of task {task.name or task.task_id[:8]} ({task.state.lower()})",
                                 target=procs.get(where)))
    return out


def _runs_at(task: RayTaskRecord, actors: dict[str, RayActorRecord]) -> tuple[str | None, int] | None:
    """(node, pid) that runs ``task``: its worker, or for an actor task still queued, the actor's process."""
    if task.worker_pid is not None:
        return task.node, task.worker_pid
    actor = actors.get(task.actor_id or "")
    return (actor.node, actor.pid) if actor is not None and actor.pid else None


def tcp_waits(bundle: Bundle) -> list[CrossNodeWait]:
    """Threads blocked reading a TCP connection whose other end a process on another node holds (the exact
    4-tuple, kvdiag.analyze.tcp_match)."""
    machine = bundle.host.machine
    index = TcpIndex(bundle)
    procs: dict[tuple[str | None, int], ProcessEvidence] = {(p.node, p.pid): p for p in bundle.processes if p.node}
    out: list[CrossNodeWait] = []
    for (node, pid), p in procs.items():
        for t in classify_process(p, machine):
            if t.kind is not WaitKind.IO_READ or t.timed or t.running:
                continue
            for f in t.blocked_fds:
                ends = split_connection(f.address) if (f.proto or "").startswith("tcp") and not f.peer_pids else None
                match = index.other_end((node, pid), *ends) if ends is not None else None
                if match is None or not match.resolved:
                    continue
                peer = match.peers[0]
                out.append(CrossNodeWait(waiter=p, thread=t, target_node=peer.node or "?", target_pid=peer.pid,
                                         how=f"TCP read of {f.address}", target=procs.get(peer.key)))
    return out


def _label(proc: ProcessEvidence, bundle: Bundle) -> str:
    actor = next((a for a in (bundle.fleet.actors if bundle.fleet else [])
                  if a.node == proc.node and a.pid == proc.pid), None)
    what = f", actor {actor.class_name}{' ' + actor.name if actor.name else ''}" if actor else ""
    return f"node {proc.node} pid {proc.pid}{what}"


def _target_label(w: CrossNodeWait, bundle: Bundle) -> str:
    if w.target is not None:
        return _label(w.target, bundle)
    return f"node {w.target_node} pid {w.target_pid} (not captured)"


def _cites(verdict: Verdict, node: str | None, pid: int) -> bool:
    return any(i.node == node and i.pid == pid for i in verdict.evidence)


def _edge(w: CrossNodeWait, bundle: Bundle) -> WaitEdge:
    """The typed edge of a wait across nodes, citing the waiter's frame that shows it."""
    src = NodeRef(pid=w.waiter.pid, tid=w.thread.tid, node=w.waiter.node)
    dst = NodeRef(pid=w.target_pid, node=w.target_node)
    ray = w.how.startswith("ray.get")
    index = next((i for i, f in enumerate(w.thread.frames) if f.kind == "python" and f.name in _RAY_GET_FUNCS), None)
    frames = [FrameRef(pid=w.waiter.pid, tid=w.thread.tid, index=index, node=w.waiter.node)] if index is not None \
        else []
    address = w.how.removeprefix("TCP read of ") if not ray else None
    return WaitEdge(src=src, dst=dst, kind=EdgeKind.RAY_GET if ray else EdgeKind.SOCKET_READ,
                    evidence=EdgeEvidence(frames=frames, address=address,
                                          text=f"{_label(w.waiter, bundle)} waits in {w.how} on "
                                               f"{_target_label(w, bundle)}"))


def _chain_into(verdict: Verdict, w: CrossNodeWait, bundle: Bundle) -> WaitChain:
    """The verdict's wait chain with the cross-node wait in front: from the waiter on one node to the root
    of the hang on the other (the chain judged on that node, when there is one)."""
    edge = _edge(w, bundle)
    labels = {edge.src.key(): f"{_label(w.waiter, bundle)} thread {w.thread.tid}",
              edge.dst.key(): _target_label(w, bundle)}
    old = verdict.waits
    if old is not None and old.edges and old.edges[0].src.process() == edge.dst:
        return old.model_copy(update={"edges": [edge, *old.edges], "labels": {**labels, **old.labels}})
    if old is not None and old.root is not None and old.root.process() == edge.dst and not old.edges:
        return old.model_copy(update={"edges": [edge], "labels": {**labels, **old.labels}})
    root_item = next((i for i in verdict.evidence if i.node == w.target_node and i.pid == w.target_pid), None)
    root = NodeRef(pid=w.target_pid, tid=root_item.tid if root_item else None, node=w.target_node)
    labels[root.key()] = _target_label(w, bundle)
    return WaitChain(edges=[edge], root=root, root_state="hung", labels=labels,
                     root_role=root_item.role if root_item else "",
                     root_frames=list(root_item.frames) if root_item else [],
                     root_key_frames=list(root_item.key_frames or []) if root_item else [],
                     root_refs=[r.model_copy() for r in root_item.refs] if root_item else [])


def _group_of(bundle: Bundle, proc: ProcessEvidence, by: dict[str, Verdict]) -> str | None:
    """The ``node/group`` key of ``by`` that judged ``proc`` (its engine's, else its node's loose group)."""
    if proc.engine and f"{proc.node}/{proc.engine}" in by:
        return f"{proc.node}/{proc.engine}"
    loose = [p for p in bundle.processes if p.node == proc.node and not (p.engine and f"{p.node}/{p.engine}" in by)]
    key = f"{proc.node}/pid-{loose[0].pid}" if loose else None
    return key if key in by else None


def waiting_on_hung_peers(bundle: Bundle, by: dict[str, Verdict]) -> dict[str, Verdict]:
    """The per-group verdicts of a merged bundle with every group that waits forever on a hung process of
    another node shown so: its own stacks look idle (a thread parked in ray.get or a socket read), but its
    wait ends at a hang, so it is blocked on that peer, never healthy."""
    out = dict(by)
    machine = bundle.host.machine
    for w in ray_get_waits(bundle) + tcp_waits(bundle):
        key = _group_of(bundle, w.waiter, out)
        mine = out.get(key) if key is not None else None
        if key is None or mine is None or mine.kind is not VerdictKind.HEALTHY or w.target is None:
            continue
        target_v = analyze_process(w.target, machine, w.target.engine)
        if target_v is None or not target_v.kind.is_hang:
            continue
        item = cite_item(w.thread, f"waits in {w.how} on {_target_label(w, bundle)}, which is hung",
                         w.waiter.engine, CONTEXT_KEYS)
        item.node = w.waiter.node
        for ref in item.refs:
            ref.node = w.waiter.node
        out[key] = Verdict(
            kind=VerdictKind.BLOCKED_IPC_READ, confidence=Confidence.MEDIUM, engine=mine.engine, evidence=[item],
            summary=(f"{key}: {_label(w.waiter, bundle)} waits forever in {w.how} on {_target_label(w, bundle)}, "
                     f"which is hung ({target_v.kind.value}): blocked on that peer, a consequence of its hang"),
            findings=[Finding(kind="waits_on_hung_peer", node=w.waiter.node, pid=w.waiter.pid,
                              message=f"{_label(w.waiter, bundle)} waits on {_target_label(w, bundle)}: "
                                      f"{target_v.kind.value} there")])
    return out


def across_nodes(overall: Verdict, bundle: Bundle, by: dict[str, Verdict]) -> Verdict:
    """The overall verdict of a merged bundle: the nodes that gave no evidence named with why, and the
    waits that cross nodes, each leading to the hang it ends at."""
    machine = bundle.host.machine
    out = overall.model_copy(deep=True)
    missing = [f for f in bundle.findings if f.kind == "node_not_captured"]
    if not by:
        names = "; ".join(f.message for f in missing) or "no node returned evidence"
        return Verdict(kind=VerdictKind.NO_EVIDENCE, confidence=Confidence.LOW, findings=missing,
                       summary=f"no process of any node could be judged: {names}")
    chains: list[str] = []
    out = _chain_across_hosts(out, bundle)
    on_chain = {(e.src.node, e.src.pid, e.src.tid) for e in out.waits.edges} if out.waits is not None else set()
    waits = [(w, analyze_process(w.target, machine, w.target.engine) if w.target is not None else None)
             for w in ray_get_waits(bundle) + tcp_waits(bundle)]
    for w, target_v in waits:
        if (w.waiter.node, w.waiter.pid, w.thread.tid) in on_chain:
            continue   # already a step of the chain the verdict follows
        # The worst verdict is a waiter whose wait ends at a hung process on another node: that one is the cause.
        if target_v is None or not target_v.kind.is_hang or not _cites(out, w.waiter.node, w.waiter.pid) or \
                _cites(out, w.target_node, w.target_pid):
            continue
        cause = next((v for v in by.values() if _cites(v, w.target_node, w.target_pid)), None)
        if cause is not None:
            consequence = out
            out = cause.model_copy(deep=True)
            out.findings.append(Finding(kind="waits_on_hung_peer", node=w.waiter.node, pid=w.waiter.pid, message=(
                f"{_label(w.waiter, bundle)} waits across nodes on {_target_label(w, bundle)}, which is itself hung "
                f"({target_v.kind.value}): a consequence, not the cause. {consequence.summary}")))
            out.findings += [f for f in consequence.findings if f not in out.findings]
    for w, target_v in waits:
        if (w.waiter.node, w.waiter.pid, w.thread.tid) in on_chain and w.how.startswith("TCP"):
            continue
        state = (f"{target_v.kind.value} there" if target_v is not None else
                 "no hang seen there" if w.target is not None else "not captured")
        across = w.target_node != w.waiter.node
        where = "across nodes" if across else "on its own node"
        text = (f"{_label(w.waiter, bundle)} (thread {w.thread.tid}) waits {where} in {w.how} on "
                f"{_target_label(w, bundle)}: {state}")
        out.findings.append(Finding(kind="waits_across_nodes" if across else "waits_on_peer", node=w.waiter.node,
                                    pid=w.waiter.pid, message=text))
        if target_v is not None and target_v.kind.is_hang and _cites(out, w.target_node, w.target_pid):
            chains.append(f"{_label(w.waiter, bundle)} → {_target_label(w, bundle)}")
            item: EvidenceItem = cite_item(w.thread, f"waits in {w.how} on {_target_label(w, bundle)}, which is hung",
                                           w.waiter.engine, CONTEXT_KEYS)
            item.node = w.waiter.node
            for ref in item.refs:
                ref.node = w.waiter.node
            out.evidence.append(item)
            out.waits = _chain_into(out, w, bundle)
    if chains:
        out.summary += "; waited on across nodes: " + "; ".join(chains)
    seen = {(f.kind, f.message) for f in out.findings}
    out.findings += [f for f in missing if (f.kind, f.message) not in seen]
    apart = [f for f in bundle.findings if f.kind == "captures_apart" and (f.kind, f.message) not in seen]
    out.findings += apart
    if apart and out.waits is not None and _crosses(out.waits) and out.confidence is Confidence.HIGH:
        out.confidence = Confidence.MEDIUM
        out.confidence_reasons.append("- the chain crosses hosts whose captures were not taken together")
    if missing:
        out.summary += f"; not captured: {', '.join(f.node or '?' for f in missing)}"
        if out.kind is VerdictKind.HEALTHY:
            out.confidence = Confidence.LOW if out.confidence is Confidence.LOW else Confidence.MEDIUM
            out.confidence_reasons.append(f"- {len(missing)} node(s) gave no evidence")
    return out


def _crosses(chain: WaitChain) -> bool:
    return any(e.src.node != e.dst.node for e in chain.edges)


def _chain_across_hosts(overall: Verdict, bundle: Bundle) -> Verdict:
    """The processes of every host judged as one graph (kvdiag.analyze.xproc, TCP connections matched across
    hosts): a chain that crosses hosts and ends in a hang is the verdict, named at its root as on one host,
    unless a worse hang elsewhere, off the chain, leads. Connections that could not be matched are named."""
    g = CrossProcess(bundle)
    cross = judge_graph(g)
    out = overall
    if cross is not None and cross.waits is not None and _crosses(cross.waits):
        on_chain = {(n.node, n.pid) for n in cross.waits.nodes()} | (
            {(cross.waits.root.node, cross.waits.root.pid)} if cross.waits.root is not None else set())
        cited = {(e.node, e.pid) for e in overall.evidence}
        if severity(cross.kind) <= severity(overall.kind) or cited <= on_chain or not overall.kind.is_hang:
            out = cross.model_copy(deep=True)
            out.engine = overall.engine if cited & on_chain else out.engine
            seen = {(f.kind, f.message) for f in out.findings}
            out.findings += [f for f in overall.findings if (f.kind, f.message) not in seen]
        else:
            out = overall.model_copy(deep=True)
            out.findings.append(Finding(kind="chain_across_hosts", message=f"also: {cross.summary}"))
    for (node, pid), _tid, match in g.tcp_matches:
        if not match.resolved:
            out.findings.append(Finding(kind=f"tcp_peer_{match.how}", node=node, pid=pid, message=match.note))
    return out


__all__ = ["CrossNodeWait", "across_nodes", "by_node", "is_merged", "node_bundles", "node_names", "on_node",
           "ray_get_waits", "tcp_waits"]
