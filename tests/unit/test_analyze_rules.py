"""Wait-for graph, frame vocabulary, and rules fed with variations of real captured processes."""

from __future__ import annotations

from pathlib import Path

from kvdiag.analyze.classify import WaitKind, classify_process
from kvdiag.analyze.overall import analyze
from kvdiag.analyze.vocab import is_system_frame, norm
from kvdiag.analyze.waitgraph import WaitGraph
from kvdiag.bundle.io import load_bundle
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import Frame
from kvdiag.model.kinds import Confidence, GilState, VerdictKind

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


def load(name: str) -> Bundle:
    return load_bundle(BUNDLES / name)[0]


def test_waitgraph_finds_each_cycle_once() -> None:
    g = WaitGraph()
    for n in "abcd":
        g.node(n, n.upper())
    g.edge("a", "b", "waits for")
    g.edge("b", "c", "held by")
    g.edge("c", "a", "waits for")
    g.edge("c", "d", "waits for")
    g.edge("d", "d", "self")           # self loops are ignored
    cycles = g.cycles()
    assert cycles == [["a", "b", "c"]]
    assert g.describe_cycle(cycles[0]) == ["A", "B", "C"]
    assert g.edge_between("b", "c") is not None and g.edge_between("c", "b") is None


def test_norm_and_system_frames() -> None:
    assert norm("pthread_cond_wait@@GLIBC_2.3.2") == "pthread_cond_wait"
    assert norm("___pthread_cond_timedwait64") == "pthread_cond_timedwait"
    assert norm("__GI___futex_abstimed_wait_cancelable64") == "futex_abstimed_wait_cancelable"
    assert norm("poll_schedule_timeout.constprop.0") == "poll_schedule_timeout"
    assert is_system_frame(Frame(name="take_gil", file="Python/ceval_gil.h", line=231))
    assert is_system_frame(Frame(name="ffi_call", library="/usr/lib/x86_64-linux-gnu/libffi.so.8"))
    assert not is_system_frame(Frame(name="map_pages", file="/src/gil_cycle.c", line=26))
    assert not is_system_frame(Frame(name="<module>", kind="python", file="x.py", line=1))


def test_holder_inferred_when_no_interpreter_flag() -> None:
    """gdb frames alone (the GIL-holder flags removed): the one thread blocked outside the GIL is the holder."""
    bundle = load("gil_cycle_no_pystack")
    for p in bundle.processes:
        for t in p.threads:
            t.gil_by_tool.clear()
            t.gil = GilState.UNKNOWN
            t.in_gil_struct = None
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.GIL_CYCLE
    assert "holder inferred" in verdict.summary and verdict.confidence is not Confidence.HIGH
    assert any("alloc_page" in f for f in verdict.evidence[0].frames)


def test_running_holder_is_contention_not_a_cycle() -> None:
    bundle = load("healthy_busy")
    views = classify_process(bundle.processes[0])
    assert any(v.kind is WaitKind.GIL_WAIT for v in views) or any(v.running for v in views)
    assert any(v.running for v in views)
    assert analyze(bundle).kind is VerdictKind.HEALTHY


def test_lost_wakeup_needs_no_possible_signaller() -> None:
    bundle = load("lost_wakeup")
    assert analyze(bundle).kind is VerdictKind.LOST_WAKEUP
    # a thread that is still running could signal: then it is not a lost wakeup
    main = next(t for t in bundle.processes[0].threads if t.tid == bundle.processes[0].pid)
    main.cpu_ticks_delta = 25
    assert analyze(bundle).kind is VerdictKind.HEALTHY


def test_blocked_read_in_a_server_with_an_event_loop_is_idle() -> None:
    """A reader thread next to an event loop is a normal client library, not a stuck IPC call."""
    bundle = load("ipc_read")
    proc = bundle.processes[0]
    reader = next(t for t in proc.threads if t.tid == proc.pid)
    assert analyze(bundle).kind is VerdictKind.BLOCKED_IPC_READ
    reader.tid = proc.pid + 100000                  # no longer the main thread...
    idle = load("healthy_idle")
    loop = next(t for p in idle.processes for t in p.threads if t.wchan and "poll" in t.wchan)
    proc.threads.append(loop.model_copy(update={"tid": proc.pid}))   # ...and an event loop runs the show
    assert analyze(bundle).kind is not VerdictKind.BLOCKED_IPC_READ
