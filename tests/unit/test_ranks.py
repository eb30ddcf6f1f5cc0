"""The rank analyzer on bundles captured from real jobs: gloo ranks (tests/fixtures/ranks/gloo_job.py) and a
real vLLM TP=2 engine whose rank 1 hung in a GIL cycle of its own."""

from __future__ import annotations

from pathlib import Path

from kvdiag.analyze.overall import analyze
from kvdiag.analyze.ranks import judge_ranks, rank_groups
from kvdiag.bundle.io import load_bundle
from kvdiag.capture.ranks import rank_from_environ
from kvdiag.model.bundle import Bundle
from kvdiag.model.fleet import FleetRecord, NodeRecord
from kvdiag.model.kinds import VerdictKind
from kvdiag.model.waits import EdgeKind
from kvdiag.runs.fleet.merge import NodePart, merge_parts

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


def _bundle(name: str) -> Bundle:
    bundle = load_bundle(BUNDLES / name)[0]
    bundle.diagnosis = None
    return bundle


def test_rank_identity_keeps_only_the_rendezvous() -> None:
    ident = rank_from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.2",
                               "MASTER_PORT": "29500", "HF_TOKEN": "hf_secret", "PATH": "/usr/bin"})
    assert ident is not None and (ident.rank, ident.local_rank, ident.world_size) == (3, 1, 8)
    assert ident.job_key() == "10.0.0.2:29500/8"
    assert "hf_secret" not in ident.model_dump_json()
    assert rank_from_environ({"PATH": "/usr/bin", "WORLD_SIZE": "2"}) is None


def test_mismatched_collectives_name_the_rank_in_broadcast() -> None:
    bundle = _bundle("gloo_mismatch_2")
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.COLLECTIVE_MISMATCH
    assert "rank 0 waits in all_reduce at gloo_job.py:68" in verdict.summary
    assert "rank 1 is in broadcast at gloo_job.py:72" in verdict.summary
    assert {e.pid for e in verdict.evidence} == {p.pid for p in bundle.processes}
    assert all(e.key_frames for e in verdict.evidence)


def test_a_rank_stuck_on_a_lock_never_arrived() -> None:
    verdict = analyze(_bundle("gloo_lock_4"))
    assert verdict.kind is VerdictKind.COLLECTIVE_MISMATCH
    assert verdict.summary.startswith("ranks 0,2,3 wait in all_reduce at gloo_job.py:68")
    assert "rank 1 never arrived: it is blocked on a lock at gloo_job.py:79 in stuck_on_lock" in verdict.summary
    assert verdict.waits is not None and verdict.waits.edges[0].kind is EdgeKind.COLLECTIVE


def test_a_rank_gone_from_the_host_exited() -> None:
    bundle = _bundle("gloo_lock_4")
    bundle.processes = [p for p in bundle.processes if p.rank is None or p.rank.rank != 1]
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.COLLECTIVE_MISMATCH
    assert "rank 1 never arrived: it is exited" in verdict.summary


def test_ranks_whose_sockets_moved_are_not_judged() -> None:
    bundle = _bundle("gloo_mismatch_2")
    for p in bundle.processes:
        assert p.progress is not None
        p.progress.io_delta["rchar"] = 4096
    assert judge_ranks(bundle) is None


def test_a_rank_with_its_own_hang_is_the_root_reached_from_the_waiting_rank() -> None:
    bundle = _bundle("vllm_tp2_stuck_rank")
    [group] = rank_groups(bundle)
    assert [r.label for r in group.ranks] == ["TP0", "TP1"]
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.GIL_CYCLE
    assert "rank TP0 waits in tensor_model_parallel_all_reduce" in verdict.summary
    assert "rank TP1 never arrived" in verdict.summary
    tp = {r.label: r.proc.pid for r in group.ranks if r.proc is not None}
    # The rank rule's own chain: the waiting rank to the rank that never arrived.
    own = judge_ranks(bundle)
    assert own is not None and own.waits is not None and own.waits.edges[0].kind is EdgeKind.COLLECTIVE
    assert (own.waits.edges[0].src.pid, own.waits.edges[0].dst.pid) == (tp["TP0"], tp["TP1"])
    # The verdict keeps the longer cross-process chain to the same root (from the API server through TP0).
    waits = verdict.waits
    assert waits is not None and waits.root is not None and waits.root.pid == tp["TP1"]
    assert [n.pid for n in waits.nodes()][-2:] == [tp["TP0"], tp["TP1"]]


def _on_nodes(bundle: Bundle, nodes: dict[int, str]) -> list[NodePart]:
    """The 4-rank capture cut into one bundle per node (rank -> node), as `kvdiag merge` gets them."""
    parts: dict[str, Bundle] = {}
    for p in bundle.processes:
        assert p.rank is not None and p.rank.rank is not None
        p.rank.local_world_size = 2
        node = nodes[p.rank.rank]
        part = parts.setdefault(node, bundle.model_copy(update={"processes": [], "engines": []}))
        part.processes.append(p)
    return [NodePart(record=NodeRecord(node=n, outcome="captured", pids=[p.pid for p in b.processes]), bundle=b)
            for n, b in parts.items()]


def test_ranks_across_nodes_are_grouped_in_a_merged_bundle() -> None:
    parts = _on_nodes(_bundle("gloo_lock_4"), {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"})
    merged = merge_parts(parts, command="merge", fleet=FleetRecord())
    verdict = analyze(merged)
    assert verdict.kind is VerdictKind.COLLECTIVE_MISMATCH
    # ranks on more than one node are named with their node
    assert verdict.summary.startswith("ranks 0,2,3 on node-a,node-b wait in all_reduce")
    assert "rank 1 on node-a never arrived: it is blocked on a lock" in verdict.summary
    assert {(e.node, e.pid) for e in verdict.evidence} == {(p.node, p.pid) for p in merged.processes}


def test_ranks_of_a_node_not_captured_are_named_so() -> None:
    parts = _on_nodes(_bundle("gloo_lock_4"), {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"})
    parts = [parts[0], NodePart(record=NodeRecord(node="node-b", outcome="refused", reason="ptrace refused"))]
    verdict = analyze(merge_parts(parts, command="merge", fleet=FleetRecord()))
    assert verdict.kind is VerdictKind.COLLECTIVE_MISMATCH
    assert "rank 2 never arrived: it is not captured (it runs on another host, or exited)" in verdict.summary


def test_without_the_progress_window_only_different_collectives_count() -> None:
    lock = _bundle("gloo_lock_4")
    for p in lock.processes:
        p.progress = None
    assert judge_ranks(lock) is None   # rank 1 outside a collective proves nothing without /proc
    mismatch = _bundle("gloo_mismatch_2")
    for p in mismatch.processes:
        p.progress = None
    verdict = judge_ranks(mismatch)
    assert verdict is not None and verdict.kind is VerdictKind.COLLECTIVE_MISMATCH


def test_a_rank_whose_cpu_advanced_is_slow_not_hung() -> None:
    bundle = _bundle("gloo_lock_4")
    odd = next(p for p in bundle.processes if p.rank is not None and p.rank.rank == 1)
    assert odd.progress is not None
    odd.progress.cpu_ticks = 40
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.SLOW_START and verdict.kind.exit_code == 0
    assert verdict.summary.startswith("slow, not hung: ranks 0,2,3 wait in all_reduce")
    assert "rank 1 is in a long compute at gloo_job.py:79" in verdict.summary


def test_real_vllm_tp2_rank_in_a_barrier_the_other_never_calls() -> None:
    """scenarios/tp2-vllm-cpu-mismatch.yaml: rank 1 calls a barrier rank 0 never calls, rank 0 is in the forward
    pass's all-reduce; the chain comes from the API server."""
    bundle = _bundle("vllm_tp2_mismatch")
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.COLLECTIVE_MISMATCH
    assert verdict.summary.startswith("rank TP0 waits in tensor_model_parallel_all_reduce at "
                                      "vocab_parallel_embedding.py:562 in forward")
    assert "rank TP1 is in barrier at __init__.py" in verdict.summary and "rank_local_barrier" in verdict.summary
    waits = verdict.waits
    assert waits is not None
    assert [e.kind for e in waits.edges] == [EdgeKind.ZMQ, EdgeKind.SHM_RING, EdgeKind.COLLECTIVE]
    roles = {p.pid: p.role.value for p in bundle.processes}
    assert roles[waits.edges[0].src.pid] == "api_server"


def test_ranks_no_environment_names_are_grouped_by_parent_and_named_by_pid() -> None:
    """Ranks started by torch.multiprocessing.spawn get their rank as an argument: siblings in collectives."""
    bundle = _bundle("gloo_mismatch_2")
    for p in bundle.processes:
        p.rank = None
    first, second = (p.pid for p in bundle.processes if p.rank is None)
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.COLLECTIVE_MISMATCH
    assert f"pid {first} waits in all_reduce at gloo_job.py:68" in verdict.summary
    assert f"pid {second} is in broadcast at gloo_job.py:72" in verdict.summary


def _set_step(bundle: Bundle, steps: dict[int, int]) -> None:
    """Each rank's step counter on its calling frame, as py-spy --locals reads it (Frame.counters)."""
    for p in bundle.processes:
        if p.rank is not None and p.rank.rank in steps:
            for t in p.threads:
                for f in t.frames:
                    if f.name in ("step_all_reduce", "stuck_on_lock", "mismatched_broadcast"):
                        f.counters["step"] = steps[p.rank.rank]


def test_each_ranks_step_is_named_and_ranks_at_another_step_left() -> None:
    bundle = _bundle("gloo_lock_4")
    _set_step(bundle, {0: 412, 1: 412, 2: 412, 3: 412})
    verdict = analyze(bundle)
    assert verdict.summary.startswith("ranks 0,2,3 wait in all_reduce (step 412) at gloo_job.py:68"), verdict.summary
    # the same collective at the same call site, one step ahead: that rank left the group's step
    _set_step(bundle, {3: 413})
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.COLLECTIVE_MISMATCH
    assert verdict.summary.startswith("ranks 0,2 wait in all_reduce (step 412) at gloo_job.py:68"), verdict.summary
    assert "rank 3 is in all_reduce (step 413) at gloo_job.py:68" in verdict.summary
    assert "rank 1 never arrived: it is blocked on a lock" in verdict.summary


def test_a_step_read_for_some_ranks_only_does_not_split_the_group() -> None:
    bundle = _bundle("gloo_lock_4")
    _set_step(bundle, {0: 412, 3: 413})     # ranks 2's step not read: steps are not compared
    verdict = analyze(bundle)
    assert verdict.summary.startswith("ranks 0,2,3 wait in all_reduce at gloo_job.py:68"), verdict.summary


def test_without_the_progress_window_steps_are_not_compared() -> None:
    bundle = _bundle("gloo_lock_4")
    _set_step(bundle, {0: 412, 1: 412, 2: 412, 3: 413})
    for p in bundle.processes:
        p.progress = None
    rank3 = next(r for g in rank_groups(bundle) for r in g.ranks if r.label == "3")
    assert rank3.step == 413 and rank3.key == ("all_reduce", rank3.site, None)
