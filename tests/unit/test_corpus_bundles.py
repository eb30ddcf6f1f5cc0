"""The analyzer on one run's bundles of the whole hangers corpus (tests/fixtures/bundles/corpus).

Saved by ``python benchmarks/accuracy.py --keep-bundles tests/fixtures/bundles/corpus``: each is a
real capture (/proc, py-spy, pystack, gdb) of a program in tests/fixtures/hangers. The expected
outcome is hanger_kit.KINDS[name].expect: how the program was written, not what the analyzer said.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvdiag.analyze.diagnosis import exit_code_for
from kvdiag.analyze.overall import analyze
from kvdiag.bundle.io import load_bundle
from kvdiag.capture.merge import bundle_without_tool
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import VerdictKind

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CORPUS = FIXTURES / "bundles" / "corpus"
sys.path.insert(0, str(FIXTURES / "hangers"))
import hanger_kit as hk  # noqa: E402

NAMES = sorted(p.name for p in CORPUS.iterdir() if (p / "bundle.json").is_file()) if CORPUS.is_dir() else []
TOOLS = ("proc", "py-spy", "pystack", "gdb")


def load(name: str) -> Bundle:
    return load_bundle(CORPUS / name)[0]


def test_the_corpus_covers_every_verdict_kind_of_the_contract() -> None:
    expected = {hk.KINDS[n].expect for n in NAMES}
    # CONTRACT.md's kinds (unknown: no rule matched, not a program shape) and the ones issues 13/18 added
    contract = {"healthy", "slow_start", "gil_cycle", "lock_order_inversion", "lost_wakeup", "blocked_ipc_read",
                "decode_stall", "crash", "oom", "gil_held_blocked", "stopped", "traced"}
    assert contract <= expected, contract - expected
    assert len(NAMES) >= 40


@pytest.mark.parametrize("name", NAMES)
def test_corpus_bundle_gets_its_expected_outcome(name: str) -> None:
    verdict = analyze(load(name))
    assert verdict.kind.value == hk.KINDS[name].expect, verdict.summary
    code = exit_code_for(verdict)
    assert code == {"crash": 4, "oom": 4, "stopped": 5, "traced": 5}.get(verdict.kind.value,
                                                                          10 if verdict.kind.is_hang else 0)


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("name", [n for n in NAMES if hk.KINDS[n].expect in ("healthy", "slow_start")])
def test_a_progressing_program_is_never_a_deadlock_whatever_tool_is_missing(name: str, tool: str) -> None:
    verdict = analyze(bundle_without_tool(load(name), tool))
    assert not verdict.kind.is_hang, verdict.summary


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("name", [n for n in NAMES if VerdictKind(hk.KINDS[n].expect).is_hang])
def test_a_hanging_program_is_never_called_healthy_whatever_tool_is_missing(name: str, tool: str) -> None:
    verdict = analyze(bundle_without_tool(load(name), tool))
    assert verdict.kind not in (VerdictKind.HEALTHY, VerdictKind.SLOW_START), verdict.summary


@pytest.mark.parametrize("name", ["healthy_blocking_server", "ipc_read_tcp", "ipc_read_asyncio", "healthy_asyncio"])
def test_without_proc_an_unresolved_wait_is_inconclusive_and_says_what_is_missing(name: str) -> None:
    """An idle server and a client whose peer stopped answering have the same stacks: only /proc's fd
    peers tell them apart. Without them: neither a deadlock nor healthy, exit 6, the missing evidence named."""
    verdict = analyze(bundle_without_tool(load(name), "proc"))
    assert verdict.kind is VerdictKind.INCONCLUSIVE and exit_code_for(verdict) == 6
    assert "/proc was not read" in verdict.summary and "fd" in verdict.summary


def test_without_proc_frames_that_show_the_role_still_decide() -> None:
    """A multiprocessing worker reading its parent's pipe waits for orders; a parent reading its workers'
    queue waits for their results (from the Python frames alone)."""
    assert analyze(bundle_without_tool(load("healthy_pipe_worker"), "proc")).kind is VerdictKind.HEALTHY
    verdict = analyze(bundle_without_tool(load("ipc_read_mpqueue"), "proc"))
    assert verdict.kind is VerdictKind.BLOCKED_IPC_READ and verdict.confidence.value == "low"


def test_traced_without_proc_is_named_by_the_preflight_or_inferred_from_every_attach_refused() -> None:
    bundle = bundle_without_tool(load("traced"), "proc")
    assert all(t.tracer_pid is None and not t.threads for t in bundle.processes)
    access = bundle.processes[0].access
    assert access is not None and access.tracer_pid
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.TRACED and f"pid {access.tracer_pid}" in verdict.summary
    access.tracer_pid = None      # a preflight that did not read TracerPid: the tools' refusals still tell
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.TRACED and "Operation not permitted" in verdict.summary
    assert verdict.confidence.value == "medium"


def test_stopped_without_proc_is_named_by_the_preflight() -> None:
    for name in ("stopped", "stopped_gil_cycle"):
        verdict = analyze(bundle_without_tool(load(name), "proc"))
        assert verdict.kind is VerdictKind.STOPPED and exit_code_for(verdict) == 5, verdict.summary


def test_removing_proc_drops_what_only_proc_wrote() -> None:
    bundle = bundle_without_tool(load("stopped"), "proc")
    assert not any(f.kind == "target_stopped" for f in bundle.findings)
    p = bundle.processes[0]
    assert p.progress is None and p.state.value == "unknown" and p.access is not None
    assert all(not t.blocked_fds and t.cpu_ticks_delta is None and t.wchan is None for t in p.threads)


def _only(name: str) -> Bundle:
    if name not in NAMES:
        pytest.skip(f"{name} not in the saved corpus (its binding package was missing when it was saved)")
    return load(name)


def test_gil_held_blocked_cites_holder_and_waiters() -> None:
    verdict = analyze(_only("gil_held_queue"))
    assert verdict.kind is VerdictKind.GIL_HELD_BLOCKED
    holder, *waiters = verdict.evidence
    assert any(f.startswith("hold_gil_and_sleep") for f in holder.frames)
    assert "both samples" in holder.role or "window" in holder.role
    assert len(waiters) == 2 and all("waits for the GIL" in w.role for w in waiters)


def test_gil_held_without_waiters_warns() -> None:
    for name, frame in (("gil_held_sleep", "hold_gil_and_sleep"), ("gil_held_condvar", "hold_gil_and_wait")):
        verdict = analyze(_only(name))
        assert verdict.kind is VerdictKind.HEALTHY
        assert any(f.kind == "gil_held_blocked" and frame in f.message for f in verdict.findings), name


def test_timed_signaller_is_a_possible_signaller_not_a_lost_wakeup() -> None:
    bundle = _only("healthy_timed_signaller")
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.HEALTHY
    # the consumer alone looks exactly like a lost wakeup: only the producer's timed wait says otherwise
    assert any(t.name == "consumer" for p in bundle.processes for t in p.threads)


def test_stopped_target_names_what_its_stacks_show() -> None:
    verdict = analyze(_only("stopped_gil_cycle"))
    assert verdict.kind is VerdictKind.STOPPED and "gil_cycle" in verdict.summary
    assert exit_code_for(verdict) == 5


def test_traced_target_names_its_tracer() -> None:
    bundle = _only("traced")
    verdict = analyze(bundle)
    tracer = bundle.processes[0].tracer_pid
    assert verdict.kind is VerdictKind.TRACED and tracer is not None and f"pid {tracer}" in verdict.summary


@pytest.mark.parametrize("name", ["gil_cycle_pybind11", "gil_cycle_nanobind", "gil_cycle_pybind11_stripped"])
def test_summary_names_the_first_project_frames_not_stl_or_binding_glue(name: str) -> None:
    summary = analyze(_only(name)).summary
    assert "in PagePool::alloc_page" in summary and "in PagePool::map_pages ← PagePool::prealloc_worker" in summary
    assert "std::" not in summary and "pybind11::" not in summary and "nanobind::" not in summary


def test_blocked_read_names_the_peer_process() -> None:
    bundle = _only("ipc_read_tcp")
    verdict = analyze(bundle)
    peer = next(f for p in bundle.processes for t in p.threads for f in t.blocked_fds if f.kind == "socket")
    assert peer.peer_pids and f"peer: pid {peer.peer_pids[0]}" in verdict.summary
    assert any(p.pid == peer.peer_pids[0] for p in bundle.processes)   # the silent server, in the same tree


def test_a_stack_only_reply_wait_next_to_an_idle_server_is_inconclusive() -> None:
    """Without /proc, a reply wait judged from stacks stands only when no other captured process waits for
    requests: kvdiag pauses every process of the tree in turn, and a server paused at the instants the
    client was sampled leaves the client waiting for its answer. Here the mpqueue reader (a real reply
    wait) is captured next to an idle socketserver (healthy_idle's process)."""
    bundle = bundle_without_tool(load("ipc_read_mpqueue"), "proc")
    assert analyze(bundle).kind is VerdictKind.BLOCKED_IPC_READ
    server = bundle_without_tool(load("healthy_idle"), "proc").processes[0]
    bundle.processes.append(server.model_copy(update={"pid": 4_000_000}))
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.INCONCLUSIVE and "pid 4000000" in verdict.summary, verdict.summary
