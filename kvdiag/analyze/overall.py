"""The verdict of a whole bundle: one per engine, and the overall one (the worst engine's, naming the others;
the processes judged as a whole, so a wait that crosses a process boundary is named at its root)."""

from __future__ import annotations

from kvdiag.analyze.engine_rules import engine_verdict
from kvdiag.analyze.fleet import across_nodes, by_node, is_merged, node_bundles, on_node, waiting_on_hung_peers
from kvdiag.analyze.ranks import join_chain, judge_ranks, rank_pids
from kvdiag.analyze.rulekit import severity
from kvdiag.analyze.signature import sign
from kvdiag.analyze.xverdict import judge_across, merge_across
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.run import Finding
from kvdiag.model.verdict import Verdict


def _groups(bundle: Bundle) -> list[tuple[str, list[ProcessEvidence]]]:
    names = [e.name for e in bundle.engines]
    out: list[tuple[str, list[ProcessEvidence]]] = [
        (n, [p for p in bundle.processes if p.engine == n]) for n in names]
    loose = [p for p in bundle.processes if p.engine not in names]
    if loose:
        out.append((f"pid-{loose[0].pid}", loose))
    return out


def analyze_by_engine(bundle: Bundle) -> dict[str, Verdict]:
    """Verdict per engine name (insertion order: the bundle's engine order); in a bundle merged from
    several hosts, per node and engine (``node/engine``), each node judged on its own processes."""
    if is_merged(bundle):
        return waiting_on_hung_peers(bundle, by_node(bundle, _by_engine))
    return _ranks_by_engine(_by_engine(bundle), bundle)


def _ranks_by_engine(by: dict[str, Verdict], bundle: Bundle) -> dict[str, Verdict]:
    """The engine that holds a job's ranks gets the ranks' verdict (kvdiag.analyze.ranks) where it is the
    worse one: each engine's health line then says what the overall verdict says."""
    ranks = judge_ranks(bundle)
    if ranks is None:
        return by
    cited = {e.pid for e in ranks.evidence}
    for name, procs in _groups(bundle):
        if name in by and cited & {p.pid for p in procs}:
            by[name] = _with_ranks(by[name], bundle, ranks)
    return by


def _by_engine(bundle: Bundle) -> dict[str, Verdict]:
    engines = {e.name: e for e in bundle.engines}
    out: dict[str, Verdict] = {}
    # The processes judged as a whole: a wait that crosses a process boundary is named at its root, in the
    # verdict of the engine whose process waits first.
    cross = judge_across(bundle)[0]
    for name, procs in _groups(bundle):
        pids = {p.pid for p in procs}
        if name in engines:
            relevant = [f for f in bundle.findings if f.engine == name or (f.pid is not None and f.pid in pids)]
        else:
            relevant = [f for f in bundle.findings if f.engine is None and (f.pid is None or f.pid in pids)]
        verdict = engine_verdict(name, engines.get(name), procs, bundle, relevant)
        if cross is not None and cross.waits is not None and cross.waits.edges[0].src.pid in pids:
            verdict = merge_across(verdict, cross)
        out[name] = sign(verdict, bundle)
    return out


def analyze(bundle: Bundle) -> Verdict:
    """The overall verdict: the worst engine's, with the other engines named in the summary."""
    by = analyze_by_engine(bundle)
    if is_merged(bundle):
        # A pid is unique only within its node: the processes are judged as a whole node by node, then
        # the waits that cross nodes are joined (kvdiag.analyze.fleet).
        overall = _worst(by, bundle, whole=False)
        for node, sub in node_bundles(bundle):
            cross = judge_across(sub)[0]
            if cross is not None:
                overall = merge_across(overall, on_node(cross, node))
        return _with_ranks(sign(across_nodes(overall, bundle, by), bundle), bundle)
    return _with_ranks(_worst(by, bundle), bundle)


def _with_ranks(overall: Verdict, bundle: Bundle, ranks: Verdict | None = None) -> Verdict:
    """The ranks of one job judged as a group (kvdiag.analyze.ranks): where they disagree, that is the
    verdict, unless a worse hang lies outside the group's processes (then the ranks' story is a finding)."""
    ranks = ranks if ranks is not None else judge_ranks(bundle)
    if ranks is None:
        return overall
    members = rank_pids(bundle)
    cross = overall.waits
    if cross is None and not is_merged(bundle):
        found = judge_across(bundle)[0]
        cross = found.waits if found is not None else None
    # A chain that ends in one of the ranks is explained by them; a worse hang elsewhere is not.
    ends_in_ranks = cross is not None and cross.root is not None and (cross.root.node, cross.root.pid) in members
    outside = [e for e in overall.evidence if (e.node, e.pid) not in members]
    if overall.kind.is_hang and outside and not ends_in_ranks and severity(overall.kind) < severity(ranks.kind):
        note = Finding(kind="ranks", engine=ranks.engine, message=f"{ranks.kind.value}: {ranks.summary}")
        return overall.model_copy(update={"findings": overall.findings + [note]})
    if cross is not None and ranks.waits is not None:
        # The chain from further out (the API server, the EngineCore) up to the first rank, then the ranks'.
        ranks = ranks.model_copy(update={"waits": join_chain(cross, ranks.waits, members)})
    return sign(ranks, bundle)


_NOTHING_TO_JUDGE = frozenset({VerdictKind.EXITED, VerdictKind.ZOMBIE, VerdictKind.NOT_PYTHON,
                               VerdictKind.KERNEL_THREAD})


def _worst(by: dict[str, Verdict], bundle: Bundle, whole: bool = True) -> Verdict:
    if not by:
        return Verdict(kind=VerdictKind.HEALTHY, confidence=Confidence.LOW,
                       summary="the bundle holds no engines and no captured processes: nothing to diagnose")
    # Of equal severity, a group on a node named as not (fully) captured never heads the verdict: a
    # node whose stack tools were refused may show only Python stacks, too little to lead with.
    partial = tuple(f"{f.node}/" for f in bundle.findings if f.kind == "node_not_captured" and f.node)
    # A group with nothing in it to judge (it exited, a zombie, no Python, a kernel thread) says nothing of the
    # others: where any other group was judged, it is named beside their verdict, never instead of it.
    judged = any(v.kind not in _NOTHING_TO_JUDGE for v in by.values())
    ranked = sorted(by.items(), key=lambda kv: (judged and kv[1].kind in _NOTHING_TO_JUDGE, severity(kv[1].kind),
                                                bool(partial) and kv[0].startswith(partial)))
    name, worst = ranked[0]
    overall = worst.model_copy(deep=True)
    if whole and len(ranked) > 1 and all(v.kind is VerdictKind.HEALTHY for _, v in ranked):
        # Nothing heads a healthy run: every engine is named, none singled out.
        overall.engine = None
        overall.summary = f"all {len(ranked)} engines healthy: " + "; ".join(v.summary for _, v in ranked)
    elif len(ranked) > 1:
        others = ", ".join(f"{n}: {v.kind.value}" for n, v in ranked[1:])
        overall.summary = f"{overall.summary} (other engines: {others})"
    seen = {(f.kind, f.message) for f in overall.findings}
    extra: list[Finding] = []
    for _, v in ranked[1:]:
        for f in v.findings:
            if (f.kind, f.message) not in seen:
                seen.add((f.kind, f.message))
                extra.append(f)
    overall.findings += extra
    return sign(overall, bundle)
