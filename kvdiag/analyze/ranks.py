"""Ranks of one collective group judged together: the rank that left the collective, and where it went.

In tensor, pipeline, data or expert parallelism every rank must call the same collectives in the same
order. When one rank takes a rank-local branch (calls another collective, blocks before it, exits), every
other rank waits in its collective forever, and each process on its own looks idle in a normal wait. So
the processes that are ranks of one job (:class:`kvdiag.model.ranks.RankIdentity` from their environment, or
vLLM's worker titles under one parent) are grouped, and for each rank the collective it sits in (the
torch.distributed call or vLLM's own: its shared-memory broadcast, custom all-reduce, pynccl, the group
coordinator), the frame that called it, or, for a rank in none, where it is instead.

- ranks advancing (their sockets moved during the window) or all in the same collective at the same call
  site (and step, where every one's step was read): nothing to say here (the process rules judge them);
- ranks in different collectives, at different call sites or at different steps: ``collective_mismatch``,
  naming the rank(s) that left and where;
- a rank that never arrived: ``collective_mismatch`` naming where it is (blocked elsewhere, exited), or,
  when its own process shows a hang, that hang as the root with the chain from the waiting ranks;
- a rank in a long compute (its CPU advancing) or a wait that ends by itself (a sleep, a timed wait): slow,
  not hung (``slow_start``), never a deadlock.

A rank's step is the integer step counter (``step``, ``seq``, ...) that capture read from the frames
between its collective and the outermost frame (py-spy --locals, every other local dropped), innermost
first; ranks on more than one node are named with their node.

Pure: reads the bundle only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdiag.analyze import vocab as v
from kvdiag.analyze.classify import ThreadView, WaitKind, classify_process
from kvdiag.analyze.evidence import item_of
from kvdiag.analyze.fleet import is_merged
from kvdiag.analyze.process import analyze_process
from kvdiag.analyze.rulekit import WAIT_WORDS, severity
from kvdiag.analyze.vllm_titles import process_title
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import Frame, ProcessEvidence
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.ranks import STEP_LOCALS
from kvdiag.model.run import Finding
from kvdiag.model.verdict import EvidenceItem, Verdict
from kvdiag.model.waits import EdgeEvidence, EdgeKind, NodeRef, WaitChain, WaitEdge

# torch.distributed's collectives and point-to-point calls (distributed_c10d.py); the outermost one a rank
# is in is the call it made (all_gather_object runs all_gather).
C10D_OPS = frozenset({
    "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "barrier",
    "monitored_barrier", "send", "recv", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list", "batch_isend_irecv", "wait",
})
# vLLM's own collective paths (vllm/distributed/...): which file says which path; the group coordinator's
# method (parallel_state.py) names the op every rank should be in.
_VLLM_PATHS = (("shm_broadcast.py", "shm broadcast"), ("custom_all_reduce.py", "custom all-reduce"),
               ("quick_all_reduce.py", "quick all-reduce"), ("pynccl.py", "pynccl"),
               ("parallel_state.py", "group coordinator"), ("communication_op.py", "communication op"))
_VLLM_OPS = frozenset({
    "all_reduce", "broadcast", "broadcast_object", "broadcast_object_list", "broadcast_tensor_dict", "all_gather",
    "reduce_scatter", "gather", "barrier", "send", "recv", "send_object", "recv_object", "send_tensor_dict",
    "recv_tensor_dict", "enqueue", "dequeue", "acquire_read", "acquire_write", "custom_all_reduce",
    "all_reduce_reg", "all_reduce_unreg", "tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather",
    "tensor_model_parallel_gather",
})
# A rank whose own threads used this many CPU ticks over the window is computing, not parked.
COMPUTE_TICKS = 2


@dataclass
class RankState:
    """One rank as the group rule sees it."""

    label: str                       # "0", "TP1"
    order: int                       # for sorting ranks: the rank number
    proc: ProcessEvidence | None     # None: no process of this rank was captured
    op: str | None = None            # the collective it sits in ("all_reduce", "shm broadcast dequeue")
    via: str | None = None           # the library path: "torch.distributed (gloo)", "vLLM shm broadcast"
    site: str | None = None          # the frame that called it: "model_runner.py:88 in execute_model"
    thread: ThreadView | None = None  # the thread in the collective, else the main thread
    op_index: int | None = None      # frame index of the collective call (in thread.frames)
    site_index: int | None = None    # frame index of its caller
    where: str = ""                  # for a rank in no collective: where it is instead
    computing: bool = False          # its CPU advanced during the window
    timed: bool = False              # not in a collective but in a wait that ends by itself (a sleep, a timeout)
    sampled: bool = False            # /proc's progress window read it (CPU and I/O over the window)
    advanced: bool = False           # its I/O advanced during the window (sockets, pipes)
    exited: bool = False
    step: int | None = None          # the step counter read from its frames (None: none read)
    by_step: bool = False            # every rank of its group in a collective had its step read: they must agree
    node: str | None = None          # its node, where the group's ranks are on more than one

    @property
    def name(self) -> str:
        name = self.label if self.label.startswith("pid ") else f"rank {self.label}"
        return f"{name} on {self.node}" if self.node else name

    @property
    def key(self) -> tuple[str, str, int | None] | None:
        """Where it is, as the ranks of one step must agree: the collective, its call site (and its step)."""
        return None if self.op is None else (self.op, self.site or "", self.step if self.by_step else None)


@dataclass
class RankGroup:
    """The captured ranks of one job (one process group), and the ranks it should have."""

    key: str
    ranks: list[RankState] = field(default_factory=list)
    world_size: int | None = None
    # Ranks that may run on a host not in this bundle (world size beyond the ranks local to captured hosts).
    spans_hosts: bool = False

    def missing(self) -> list[int]:
        if self.world_size is None:
            return []
        have = {r.order for r in self.ranks}
        return [n for n in range(self.world_size) if n not in have]


def _short_file(path: str | None) -> str:
    return os.path.basename(path or "") or "?"


def _c10d_op(f: Frame) -> str | None:
    if f.kind != "python" or not (f.file or "").endswith("distributed_c10d.py"):
        return None
    name = f.name.rsplit(".", 1)[-1]
    return name if name in C10D_OPS else None


def _vllm_op(f: Frame) -> tuple[str, str] | None:
    file = f.file or ""
    if f.kind != "python" or "vllm/distributed/" not in file.replace("\\", "/"):
        return None
    name = f.name.rsplit(".", 1)[-1]
    for suffix, path in _VLLM_PATHS:
        if file.endswith(suffix) and name in _VLLM_OPS:
            return name, path
    return None


def _library_frame(f: Frame) -> bool:
    """A frame inside the collective's libraries (the caller is the first frame outside them)."""
    file = (f.file or "").replace("\\", "/")
    return f.kind == "python" and ("/torch/" in file or file.startswith("torch/") or "vllm/distributed/" in file
                                   or "c10d_logger" in file or f.name.endswith("wrapper"))


def _backend(proc: ProcessEvidence) -> str | None:
    """gloo or NCCL, from the process's threads: their names (``pt_gloo_runloop``, ``pt_nccl_watchdg``) or
    native frames (the waiting thread itself shows only ``c10d::Work::wait``)."""
    for t in proc.threads:
        text = (t.name or "") + " " + " ".join(f.name for f in t.frames if f.kind == "native")
        low = text.lower()
        if "gloo" in low:
            return "gloo"
        if "nccl" in low:
            return "nccl"
    return None


def _collective(t: ThreadView, backend: str | None) -> tuple[str, str, int, int | None] | None:
    """(op, via, index of the op's frame, index of its caller) of the outermost collective call in ``t``."""
    found: tuple[str, str, int] | None = None
    for i, f in enumerate(t.frames):
        op = _c10d_op(f)
        if op is not None:
            found = (op, f"torch.distributed ({backend})" if backend else "torch.distributed", i)
            continue
        vllm = _vllm_op(f)
        if vllm is not None:
            op_name, path = vllm
            found = (op_name, f"vLLM {path}", i)
    if found is None:
        return None
    op, via, index = found
    caller = next((j for j in range(index + 1, len(t.frames))
                   if t.frames[j].kind == "python" and not _library_frame(t.frames[j])), None)
    return op, via, index, caller


def _step(proc: ProcessEvidence, t: ThreadView, start: int) -> int | None:
    """The step counter of thread ``t`` read from its frames from ``start`` outwards (any tool's frames of
    the same function: the counters come from py-spy, the frames shown may be pystack's)."""
    ev = next((x for x in proc.threads if x.tid == t.tid), None)
    stacks = [t.frames, *(ev.frames_by_tool.values() if ev is not None else ())]
    names = {(f.name.rsplit(".", 1)[-1], _short_file(f.file)) for f in t.frames[start:] if f.kind == "python"}
    for frames in stacks:
        for f in frames:
            if f.counters and f.kind == "python" and not _library_frame(f) \
                    and (f.name.rsplit(".", 1)[-1], _short_file(f.file)) in names:
                value: int | None = next((f.counters[n] for n in STEP_LOCALS if n in f.counters), None)
                if value is not None:
                    return value
    return None


def _step_text(r: RankState) -> str:
    return f" (step {r.step})" if r.step is not None else ""


def _site(f: Frame) -> str:
    return f"{_short_file(f.file)}:{f.line if f.line is not None else '?'} in {f.name}"


def _python_site(t: ThreadView) -> tuple[str, int | None]:
    """The innermost Python frame of the application (not the standard library): where a thread is."""
    for i, f in enumerate(t.frames):
        if f.kind == "python" and not v.is_stdlib_python(f):
            return _site(f), i
    return "", None


def _elsewhere(t: ThreadView, computing: bool) -> str:
    site, _ = _python_site(t)
    at = f" at {site}" if site else ""
    if computing or t.running or t.kind is WaitKind.RUNNING:
        return f"in a long compute{at} (its CPU advancing)"
    if t.kind is WaitKind.SLEEP:
        return f"sleeping{at}"
    words = WAIT_WORDS.get(t.kind)
    if words is not None:
        return f"{words}{at}"
    if t.kind is WaitKind.EVENT_WAIT:
        return f"waiting for an event (poll/select){at}"
    return f"in {t.kind.value}{at}"


def _state(label: str, order: int, proc: ProcessEvidence, machine: str | None) -> RankState:
    st = RankState(label=label, order=order, proc=proc)
    if not proc.alive or proc.state.value == "zombie":
        st.exited, st.where = True, "exited"
        return st
    p = proc.progress
    st.sampled = p is not None
    st.computing = p is not None and p.cpu_ticks >= COMPUTE_TICKS
    st.advanced = p is not None and p.advanced
    views = classify_process(proc, machine)
    backend = _backend(proc)
    for t in views:
        hit = _collective(t, backend)
        if hit is not None:
            st.op, st.via, st.op_index, st.site_index = hit
            st.thread = t
            st.site = _site(t.frames[st.site_index]) if st.site_index is not None else None
            st.step = _step(proc, t, st.op_index)
            return st
    main = next((t for t in views if t.is_main), views[0] if views else None)
    st.thread = main
    if main is None:
        st.where = "no stack was read"
    else:
        st.where = _elsewhere(main, st.computing)
        st.site_index = _python_site(main)[1]
        st.step = _step(proc, main, 0)
        st.timed = main.kind is WaitKind.SLEEP or main.timed
    return st


def _tp_label(proc: ProcessEvidence) -> tuple[str, int] | None:
    title = process_title(proc) or ""
    if not title.startswith("Worker"):
        return None
    parts = title.removeprefix("Worker").strip("_").split("_")
    label = "_".join(p for p in parts if p) or "0"
    digits = "".join(ch for ch in parts[-1] if ch.isdigit()) if parts else ""
    return label, int(digits) if digits else 0


def _rank_of(proc: ProcessEvidence) -> tuple[str, str, int] | None:
    """(group key, rank label, rank number) of a process that is a rank, else None."""
    ident = proc.rank
    job = ident.job_key() if ident is not None else None
    if ident is not None and job is not None and ident.rank is not None:
        return f"job {job}", str(ident.rank), ident.rank
    tp = _tp_label(proc)
    if tp is not None:
        return f"vllm {proc.node or ''}/{proc.ppid}", tp[0], tp[1]
    if _in_collective(proc):
        # A rank whose environment does not name it (torch.multiprocessing.spawn passes the rank as an
        # argument): its siblings in a collective are its group, named by pid.
        return f"spawned {proc.node or ''}/{proc.ppid}", f"pid {proc.pid}", proc.pid
    return None


def _in_collective(proc: ProcessEvidence) -> bool:
    return any(_c10d_op(f) is not None or _vllm_op(f) is not None for t in proc.threads for f in t.frames)


def rank_groups(bundle: Bundle) -> list[RankGroup]:
    """The ranks of every job in the bundle with at least two ranks (or one, with more expected)."""
    machine = bundle.host.machine
    # A node of a merged bundle that was not captured may hold the ranks missing here.
    unseen_nodes = any(f.kind == "node_not_captured" for f in bundle.findings)
    candidates: dict[tuple[str, str], list[ProcessEvidence]] = {}
    numbers: dict[tuple[str, str], int] = {}
    for proc in bundle.processes:
        found = _rank_of(proc)
        if found is not None:
            key, label, order = found
            candidates.setdefault((key, label), []).append(proc)
            numbers[(key, label)] = order
    groups: dict[str, RankGroup] = {}
    for (key, label), procs in candidates.items():
        # A child a rank started inherits its environment: the rank is the outermost of them.
        pids = {(p.node, p.pid) for p in procs}
        proc = next((p for p in procs if (p.node, p.ppid) not in pids), procs[0])
        group = groups.setdefault(key, RankGroup(key=key))
        group.ranks.append(_state(label, numbers[(key, label)], proc, machine))
        ident = proc.rank
        if ident is not None and ident.world_size is not None:
            group.world_size = max(group.world_size or 0, ident.world_size)
            local = ident.local_world_size
            if local is not None and local < ident.world_size and (not is_merged(bundle) or unseen_nodes):
                group.spans_hosts = True
    out = []
    for group in groups.values():
        for n in group.missing():
            group.ranks.append(RankState(label=str(n), order=n, proc=None, exited=True,
                                         where=("not captured (it runs on another host, or exited)"
                                                if group.spans_hosts else "exited (no process of it is left)")))
        group.ranks.sort(key=lambda r: r.order)
        in_op = [r for r in group.ranks if r.op is not None]
        nodes = {r.proc.node for r in group.ranks if r.proc is not None}
        for r in group.ranks:
            # Steps are compared only where every rank's was read inside /proc's window (one step apart in a
            # loop that runs is two readings at two moments; the window says whether it runs).
            r.by_step = bool(in_op) and all(x.step is not None and x.sampled for x in in_op)
            r.node = r.proc.node if len(nodes) > 1 and r.proc is not None else None
        if len(group.ranks) >= 2:
            out.append(group)
    return out


def _names(ranks: Sequence[RankState]) -> str:
    if len(ranks) == 1:
        return ranks[0].name
    nodes = list(dict.fromkeys(r.node for r in ranks if r.node))
    where = f" on {','.join(nodes)}" if nodes else ""
    if all(r.label.startswith("pid ") for r in ranks):
        return "pids " + ",".join(r.label.removeprefix("pid ") for r in ranks) + where
    return "ranks " + ",".join(r.label for r in ranks) + where


def _wait_text(ranks: Sequence[RankState]) -> str:
    r = ranks[0]
    verb = "waits" if len(ranks) == 1 else "wait"
    steps = {x.step for x in ranks}
    step = _step_text(r) if len(steps) == 1 else ""
    return f"{_names(ranks)} {verb} in {r.op}{step} at {r.site or '?'}"


def _item(r: RankState, role: str, engine: str | None) -> EvidenceItem | None:
    t, proc = r.thread, r.proc
    if t is None or proc is None:
        return None
    start = r.op_index if r.op_index is not None else 0
    rows: list[tuple[int, str]] = []
    for i in range(start, len(t.frames)):
        f = t.frames[i]
        if f.kind == "python" or i in (r.op_index, r.site_index):
            rows.append((i, v.describe(f)))
        if len(rows) >= 8:
            break
    if r.site_index is not None and all(i != r.site_index for i, _ in rows) and r.site_index < len(t.frames):
        rows.append((r.site_index, v.describe(t.frames[r.site_index])))
    keys = {i for i in (r.op_index, r.site_index) if i is not None}
    item = item_of(t.pid, t.tid, role, engine, rows, keys)
    item.node = proc.node
    for ref in item.refs:
        ref.node = proc.node
    return item


def _ref(r: RankState) -> NodeRef:
    assert r.proc is not None
    tid = r.thread.tid if r.thread is not None else None
    return NodeRef(pid=r.proc.pid, tid=tid, node=r.proc.node)


def _majority(ranks: Sequence[RankState]) -> list[RankState]:
    """The ranks that agree (the largest set in one collective at one call site; of equal sets, the one
    holding the lowest rank): the others left."""
    by_key: dict[tuple[str, str, int | None], list[RankState]] = {}
    for r in ranks:
        if r.key is not None:
            by_key.setdefault(r.key, []).append(r)
    if not by_key:
        return []
    return max(by_key.values(), key=lambda rs: (len(rs), -min(x.order for x in rs)))


def judge_group(group: RankGroup, machine: str | None = None) -> Verdict | None:
    """The group's verdict, or None when its ranks agree or advance (the process rules judge them)."""
    ranks = group.ranks
    if any(r.advanced for r in ranks if r.proc is not None and r.key is not None):
        return None   # a collective whose sockets moved during the window is running, not stuck
    waiting = _majority(ranks)
    if not waiting:
        return None
    left = [r for r in ranks if r not in waiting]
    if not left:
        return None
    engine = next((r.proc.engine for r in waiting if r.proc is not None), None)
    head = _wait_text(waiting)
    evidence = [item for r in waiting
                if (item := _item(r, f"{r.name} in {r.op} ({r.via}), waiting for its group", engine)) is not None]
    parts: list[str] = []
    slow = [r for r in left if r.key is None and (r.computing or r.timed) and not r.exited]
    stuck = [r for r in left if r not in slow]
    # Without /proc's window nothing says the waiting ranks did not just arrive: only ranks seen in
    # different collectives are a mismatch then.
    if not all(r.sampled for r in ranks if r.proc is not None) and any(r.key is None for r in stuck):
        return None
    for r in left:
        if r.key is not None:
            parts.append(f"{r.name} is in {r.op}{_step_text(r)} at {r.site or '?'}")
            role = f"{r.name} in {r.op} ({r.via}): left the group's collective"
        else:
            parts.append(f"{r.name} {'is' if r in slow else 'never arrived: it is'} {r.where}")
            role = f"{r.name}: not in the collective ({r.where})"
        item = _item(r, role, engine)
        if item is not None:
            evidence.append(item)
    summary = f"{head}; {'; '.join(parts)}"
    if not stuck:
        return Verdict(kind=VerdictKind.SLOW_START, confidence=Confidence.MEDIUM, engine=engine, evidence=evidence,
                       summary=f"slow, not hung: {summary}; the others wait for it in their collective")
    # A rank that never arrived because of a hang of its own: that hang is the root, reached from the
    # ranks that wait for it.
    for r in stuck:
        if r.key is not None or r.proc is None or r.exited:
            continue
        own = analyze_process(r.proc, machine, engine)
        if own is None or not own.kind.is_hang or own.kind in (VerdictKind.UNKNOWN, VerdictKind.INCONCLUSIVE):
            continue
        chain = _chain(waiting, r, own)
        return own.model_copy(update={
            "summary": f"{summary}. {r.name}'s own hang is the root: {own.summary}",
            "evidence": evidence + [e for e in own.evidence if e not in evidence],
            "waits": chain, "engine": engine,
            "findings": own.findings + [Finding(kind="ranks", engine=engine, message=summary)]})
    confidence = Confidence.HIGH if all(r.proc is not None for r in stuck) or not group.spans_hosts \
        else Confidence.MEDIUM
    chain = _chain(waiting, next((r for r in stuck if r.proc is not None), stuck[0]), None)
    return Verdict(kind=VerdictKind.COLLECTIVE_MISMATCH, confidence=confidence, engine=engine, evidence=evidence,
                   summary=summary, waits=chain)


def _chain(waiting: Sequence[RankState], root: RankState, own: Verdict | None) -> WaitChain | None:
    first = next((r for r in waiting if r.proc is not None), None)
    if first is None or root.proc is None:
        return None
    src, dst = _ref(first), _ref(root)
    text = f"{first.name} in {first.op} at {first.site or '?'} waits for {root.name} ({root.where or root.op})"
    edge = WaitEdge(src=src, dst=dst, kind=EdgeKind.COLLECTIVE, purpose="depends",
                    evidence=EdgeEvidence(text=text))
    edges = [edge]
    if own is not None and own.waits is not None and own.waits.edges:
        edges += own.waits.edges
    item = _item(root, root.name, None)
    state = "hung" if own is not None else "exited" if root.exited else "blocked"
    return WaitChain(edges=edges, root=edges[-1].dst, root_state=state,
                     labels={src.key(): f"{first.name} (pid {src.pid})", dst.key(): f"{root.name} (pid {dst.pid})"},
                     root_role=item.role if item else "", root_frames=item.frames if item else [],
                     root_key_frames=item.key_frames or [] if item else [], root_refs=item.refs if item else [])


def judge_ranks(bundle: Bundle) -> Verdict | None:
    """The worst verdict over the bundle's rank groups, or None when no group disagrees."""
    machine = bundle.host.machine
    verdicts = [vd for g in rank_groups(bundle) if (vd := judge_group(g, machine)) is not None]
    if not verdicts:
        return None
    return min(verdicts, key=lambda vd: severity(vd.kind))


def ranks_settled(bundle: Bundle) -> str | None:
    """Whether the ranks' Python frames and /proc alone settle every group (the ranks that wait need no
    pausing tool): the reason, else None. Settled: a group whose sockets moved, or whose ranks that left
    are in another collective, exited or computing. A rank blocked elsewhere is not settled: its own hang
    may need its native frames."""
    groups = rank_groups(bundle)
    if not groups:
        return None
    for g in groups:
        if any(r.advanced for r in g.ranks if r.proc is not None and r.key is not None):
            continue
        waiting = _majority(g.ranks)
        left = [r for r in g.ranks if r not in waiting]
        if not waiting or not left:
            return None
        if not all(r.key is not None or r.exited or r.computing or r.timed for r in left):
            return None
    return "the ranks' stacks name where each rank is"


def join_chain(outer: WaitChain, chain: WaitChain, members: set[tuple[str | None, int]]) -> WaitChain:
    """``outer`` (a cross-process chain) up to the first rank process it reaches, then ``chain`` (the ranks'
    own, from a waiting rank), when ``outer`` reaches the rank ``chain`` starts from; else ``chain``."""
    if not chain.edges:
        return chain
    prefix: list[WaitEdge] = []
    for e in outer.edges:
        if (e.src.node, e.src.pid) in members:
            break
        prefix.append(e)
    start = chain.edges[0].src
    if not prefix or prefix[-1].dst.process() != start.process():
        return chain
    labels = {**outer.labels, **chain.labels}
    return chain.model_copy(update={"edges": prefix + chain.edges, "labels": labels})


def rank_pids(bundle: Bundle) -> set[tuple[str | None, int]]:
    """(node, pid) of every process that is a rank of some group."""
    return {(r.proc.node, r.proc.pid) for g in rank_groups(bundle) for r in g.ranks if r.proc is not None}


__all__ = ["RankGroup", "RankState", "join_chain", "judge_group", "judge_ranks", "rank_groups", "rank_pids",
           "ranks_settled"]
