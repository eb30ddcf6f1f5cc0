"""The analyzer on saved bundles from real captures (tests/fixtures/bundles, see make_bundles.py).

No tool is mocked: every bundle was captured from a running program by kvdiag's
own backends, or (vllm_*) parsed from a real vLLM server's tool outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvdiag.analyze.classify import WaitKind, classify_process
from kvdiag.analyze.diagnosis import exit_code_for
from kvdiag.analyze.overall import analyze, analyze_by_engine
from kvdiag.bundle.io import load_bundle
from kvdiag.kvcached.banner import parse_banner
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import Confidence, EnginePhase, GilState, ProcessRole, VerdictKind
from kvdiag.model.run import EngineRecord, MetricsSnapshot

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
from make_bundles import EXPECTED  # noqa: E402

SEED_ENGINE2_BANNER = (
    "Init C++ PageAllocator: num_layers=28, mem_size_per_layer=11MB, total_mem_size=667MB, page_size=2MB, "
    "world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1, enable_prealloc=1, num_kv_buffers=2, "
    "group_id=0, min_reserved_pages=5, max_reserved_pages=5")


def load(name: str) -> Bundle:
    bundle, _ = load_bundle(FIXTURES / "bundles" / name)
    return bundle


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_saved_bundle_gets_its_expected_verdict(name: str) -> None:
    bundle = load(name)
    verdict = analyze(bundle)
    assert verdict.kind.value == EXPECTED[name], verdict.summary
    expected_code = {"crash": 4, "oom": 4, "stopped": 5, "traced": 5}.get(verdict.kind.value,
                                                                         10 if verdict.kind.is_hang else 0)
    assert exit_code_for(verdict) == expected_code
    if verdict.kind.is_hang:
        assert verdict.evidence, "a hang verdict must cite threads"
        pids = {p.pid for p in bundle.processes}
        assert all(item.pid in pids for item in verdict.evidence)


def test_seed_shape_gil_cycle_cites_alloc_page_holder_and_map_pages_waiter() -> None:
    bundle = load("gil_cycle")
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.GIL_CYCLE and verdict.confidence is Confidence.HIGH
    core = next(p for p in bundle.processes if p.role is ProcessRole.ENGINE_CORE)
    api = next(p for p in bundle.processes if p.role is ProcessRole.API_SERVER)
    assert core.pid != api.pid
    holder, waiter = verdict.evidence[0], verdict.evidence[1]
    assert holder.pid == core.pid and holder.tid == core.pid
    assert "alloc_page caller" in holder.role and "holds the GIL" in holder.role
    assert any(f.startswith("alloc_page") for f in holder.frames)
    assert any("pthread_cond_wait" in f for f in holder.frames)
    assert "prealloc worker in map_pages" in waiter.role
    assert any(f.startswith("map_pages") for f in waiter.frames)
    assert any(f.startswith("take_gil") for f in waiter.frames)
    assert len(verdict.cycle) == 4 and "GIL" in verdict.cycle[0]
    # the API server in the same tree is idle, not part of the verdict
    assert all(item.pid != api.pid for item in verdict.evidence)


def test_stripped_interpreter_gil_waiter_found_without_take_gil() -> None:
    bundle = load("gil_cycle_stripped")
    proc = bundle.processes[0]
    worker = next(t for t in proc.threads if t.tid != proc.pid)
    assert worker.gil_by_tool.get("pystack") is not GilState.WAITING          # the flag is missing...
    assert all(f.name != "take_gil" for fs in worker.frames_by_tool.values() for f in fs)
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.GIL_CYCLE                                # ...and we still see it
    role = next(e.role for e in verdict.evidence if e.tid == worker.tid)
    assert "futex in the GIL struct" in role or "PyGILState_Ensure" in role or "PyEval_RestoreThread" in role


def test_gil_cycle_from_proc_and_gdb_without_pystack() -> None:
    bundle = load("gil_cycle_no_pystack")
    assert all(t.tool != "pystack" for p in bundle.processes for t in p.tools)
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.GIL_CYCLE
    assert any("alloc_page" in f for f in verdict.evidence[0].frames)


def test_gil_cycle_from_proc_alone() -> None:
    bundle = load("gil_cycle_proc_only")
    proc = bundle.processes[0]
    assert proc.gil_futex_range is not None
    assert all(not t.frames for t in proc.threads)
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.GIL_CYCLE and verdict.confidence is not Confidence.HIGH


def test_lock_inversion_names_both_mutexes() -> None:
    verdict = analyze(load("lock_inversion"))
    assert verdict.kind is VerdictKind.LOCK_ORDER_INVERSION and verdict.confidence is Confidence.HIGH
    assert len(verdict.evidence) == 2
    waited = {e.role.rsplit(" ", 1)[-1] for e in verdict.evidence}
    held = {e.role.split("holds mutex ", 1)[1].split(",", 1)[0] for e in verdict.evidence}
    assert waited == held and len(waited) == 2      # each holds what the other waits for


def test_thread_classification_on_real_vllm_idle() -> None:
    bundle = load("vllm_idle")
    core = next(p for p in bundle.processes if p.pid == 6898)
    views = {v.tid: v for v in classify_process(core)}
    assert views[6898].kind is WaitKind.PY_LOCK_WAIT            # Queue.get
    assert views[7049].kind is WaitKind.EVENT_WAIT              # zmq poll
    assert views[7054].idle_by_design                           # ZMQbg/IO/0
    assert views[6901].idle_by_design                           # OpenBLAS blas_thread_server
    assert not any(v.running for v in views.values())


def test_banner_risk_is_reported_with_the_cycle() -> None:
    bundle = load("gil_cycle")
    banner = parse_banner(SEED_ENGINE2_BANNER)
    assert banner is not None
    bundle.engines = [EngineRecord(name="engine2", phase=EnginePhase.STALLED, banners=[banner])]
    for p in bundle.processes:
        p.engine = "engine2"
    bundle.stall_detected = True
    by_engine = analyze_by_engine(bundle)
    assert list(by_engine) == ["engine2"]
    verdict = by_engine["engine2"]
    assert verdict.kind is VerdictKind.GIL_CYCLE and verdict.engine == "engine2"
    risks = [f for f in verdict.findings if f.kind == "banner_risk"]
    assert risks and "min_reserved_pages=5" in risks[0].message
    assert all(e.engine == "engine2" for e in verdict.evidence)


def test_worst_engine_wins_and_names_the_others() -> None:
    hung, healthy = load("gil_cycle"), load("healthy_busy")
    bundle = Bundle(engines=[EngineRecord(name="engine1", phase=EnginePhase.SERVING, healthy=True),
                             EngineRecord(name="engine2", phase=EnginePhase.STALLED)],
                    processes=[*(p.model_copy(update={"engine": "engine1"}) for p in healthy.processes),
                               *(p.model_copy(update={"engine": "engine2"}) for p in hung.processes)],
                    stall_detected=True)
    by_engine = analyze_by_engine(bundle)
    assert by_engine["engine1"].kind is VerdictKind.HEALTHY
    assert by_engine["engine2"].kind is VerdictKind.GIL_CYCLE
    overall = analyze(bundle)
    assert overall.kind is VerdictKind.GIL_CYCLE and overall.engine == "engine2"
    assert "engine1: healthy" in overall.summary


def _serving(name: str = "e") -> EngineRecord:
    return EngineRecord(name=name, phase=EnginePhase.SERVING, healthy=True)


def test_decode_stall_from_metrics_with_mechanism() -> None:
    bundle = load("gil_cycle")
    for p in bundle.processes:
        p.engine = "e"
    bundle.engines = [_serving()]
    bundle.stall_window_s = 5.0
    bundle.metrics = [MetricsSnapshot(t=t, engine="e", running=21, kv_cache_usage=0.987,
                                      generation_tokens=4000 if t >= 2 else 100 * t) for t in range(0, 12)]
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.DECODE_STALL
    assert "mechanism: gil_cycle" in verdict.summary and verdict.evidence
    # the same numbers with tokens still growing are not a stall
    bundle.metrics = [m.model_copy(update={"generation_tokens": 100.0 * m.t}) for m in bundle.metrics]
    assert analyze(bundle).kind is VerdictKind.GIL_CYCLE


def test_decode_stall_needs_kv_near_full() -> None:
    bundle = Bundle(engines=[_serving()], stall_window_s=5.0,
                    metrics=[MetricsSnapshot(t=t, engine="e", running=3, kv_cache_usage=0.4, generation_tokens=50)
                             for t in range(10)])
    assert analyze(bundle).kind is VerdictKind.HEALTHY


@pytest.mark.parametrize("error, exit_code, kind", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", 1, VerdictKind.OOM),
    ("page.cpp:40 cuMemCreate failed in CUDA driver (2): CUDA_ERROR_OUT_OF_MEMORY", -6, VerdictKind.OOM),
    ("Traceback (most recent call last):\nRuntimeError: boom", 1, VerdictKind.CRASH),
    (None, -11, VerdictKind.CRASH),
])
def test_crash_and_oom_from_engine_record(error: str | None, exit_code: int, kind: VerdictKind) -> None:
    bundle = Bundle(engines=[EngineRecord(name="e", phase=EnginePhase.EXITED, exit_code=exit_code, error=error)])
    verdict = analyze(bundle)
    assert verdict.kind is kind
    assert exit_code_for(verdict) == 4


def test_slow_start_when_threads_still_run() -> None:
    bundle = load("healthy_busy")
    for p in bundle.processes:
        p.engine = "e"
    bundle.engines = [EngineRecord(name="e", phase=EnginePhase.STALLED)]
    bundle.stall_detected = True
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.SLOW_START and exit_code_for(verdict) == 0


def test_stalled_without_evidence_is_unknown_and_starting_is_slow_start() -> None:
    stalled = Bundle(engines=[EngineRecord(name="e", phase=EnginePhase.STALLED)], stall_detected=True)
    assert analyze(stalled).kind is VerdictKind.UNKNOWN
    starting = Bundle(engines=[EngineRecord(name="e", phase=EnginePhase.LOADING)])
    assert analyze(starting).kind is VerdictKind.SLOW_START


def test_empty_bundle_is_not_a_hang() -> None:
    verdict = analyze(Bundle())
    assert verdict.kind is VerdictKind.HEALTHY and exit_code_for(verdict) == 0
