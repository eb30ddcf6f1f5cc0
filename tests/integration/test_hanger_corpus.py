"""Every program of the hangers corpus gets its expected outcome from a real capture.

Each program (tests/fixtures/hangers, hanger_kit.KINDS) is started, really hangs (or really
progresses), and is captured read-only by kvdiag's own backends. To keep CI time down, most
programs are captured with /proc and py-spy only (py-spy --native gives Python and native
frames); programs whose verdict rests on what only pystack or gdb read get those too. The
expected outcome comes from how each program was written, never from the analyzer.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdiag.analyze.diagnosis import exit_code_for
from kvdiag.analyze.overall import analyze
from kvdiag.capture.bundle import capture_tree
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import VerdictKind
from kvdiag.model.verdict import Verdict

HANGERS = Path(__file__).resolve().parents[1] / "fixtures" / "hangers"
sys.path.insert(0, str(HANGERS))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hanger_kit as hk  # noqa: E402
from kvcli import run_kvdiag  # noqa: E402

pytestmark = pytest.mark.timeout(180)

QUICK = ["proc", "py-spy"]
# Programs whose verdict needs more than /proc + py-spy.
TOOLS: dict[str, list[str]] = {
    "gil_cycle_stripped": ["proc", "py-spy", "pystack"],
    "gil_cycle_pybind11_stripped": ["proc", "py-spy", "pystack"],
}
EXIT = {"crash": 4, "oom": 4, "stopped": 5, "traced": 5, "healthy": 0, "slow_start": 0}
# The cross-process programs have their own test (test_xproc_corpus.py: the CLI, the chain, the root), and so do
# the families (test_family_corpus.py: the chain in words).
CORPUS = [k for k in hk.KINDS if k not in hk.BENCH_EXCLUDE and not hk.KINDS[k].xproc
          and hk.KINDS[k].script != "families.py"]


def capture(kind: str, tmp_path: Path) -> tuple[hk.Hanger, Bundle, Verdict]:
    why = hk.available(kind)
    if why is not None:
        pytest.skip(why)
    with hk.running(kind, bound_s=90) as h:
        bundle = capture_tree(h.root_pid, tmp_path / "bundle", timeout_s=10.0, backends=TOOLS.get(kind, QUICK))
        return h, bundle, analyze(bundle)


@pytest.fixture(scope="module")
def verdicts() -> Iterator[dict[str, tuple[Bundle, Verdict]]]:
    """Filled by test_expected_outcome; the detail tests below reuse its captures."""
    yield {}


@pytest.mark.parametrize("kind", CORPUS)
def test_expected_outcome(kind: str, tmp_path: Path, verdicts: dict[str, tuple[Bundle, Verdict]]) -> None:
    spec = hk.KINDS[kind]
    h, bundle, verdict = capture(kind, tmp_path)
    verdicts[kind] = (bundle, verdict)
    assert verdict.kind.value == spec.expect, f"{kind} ({spec.shape}): {verdict.summary}"
    assert exit_code_for(verdict) == EXIT.get(spec.expect, 10)
    pids = {p.pid for p in bundle.processes}
    assert h.pid in pids
    if verdict.kind.is_hang and verdict.kind is not VerdictKind.DECODE_STALL:   # a decode stall rests on metrics
        assert verdict.evidence, "a hang verdict cites threads"
        assert all(item.pid in pids and item.frames for item in verdict.evidence[:1]), verdict.evidence


def _need(verdicts: dict[str, tuple[Bundle, Verdict]], kind: str, tmp_path: Path) -> tuple[Bundle, Verdict]:
    if kind not in verdicts:
        _, bundle, verdict = capture(kind, tmp_path)
        verdicts[kind] = (bundle, verdict)
    return verdicts[kind]


@pytest.mark.parametrize("kind,frame", [("gil_held_queue", "hold_gil_and_sleep"),
                                        ("gil_held_read_queue", "hold_gil_and_read")])
def test_gil_held_blocked_cites_holder_frames_duration_and_waiters(
        kind: str, frame: str, tmp_path: Path, verdicts: dict[str, tuple[Bundle, Verdict]]) -> None:
    _, verdict = _need(verdicts, kind, tmp_path)
    assert verdict.kind is VerdictKind.GIL_HELD_BLOCKED
    holder, *waiters = verdict.evidence
    assert "holds the GIL" in holder.role and any(f.startswith(frame) for f in holder.frames), holder
    assert "samples" in holder.role or "window" in holder.role          # how long, from two samples
    assert waiters and all("waits for the GIL" in w.role for w in waiters)
    assert frame in verdict.summary and "wait for it" in verdict.summary
    if kind == "gil_held_read_queue":
        assert "peer: pid" in holder.role                                # the silent writer, named


@pytest.mark.parametrize("kind,frame", [("gil_held_sleep", "hold_gil_and_sleep"),
                                        ("gil_held_condvar", "hold_gil_and_wait")])
def test_gil_held_without_waiters_is_healthy_with_a_warning(
        kind: str, frame: str, tmp_path: Path, verdicts: dict[str, tuple[Bundle, Verdict]]) -> None:
    _, verdict = _need(verdicts, kind, tmp_path)
    assert verdict.kind is VerdictKind.HEALTHY
    warn = [f for f in verdict.findings if f.kind == "gil_held_blocked"]
    assert len(warn) == 1 and frame in warn[0].message and "stall" in warn[0].message, verdict.findings


@pytest.mark.parametrize("kind", ["gil_cycle_pybind11", "gil_cycle_nanobind"])
def test_extension_cycle_summary_names_the_project_frame(
        kind: str, tmp_path: Path, verdicts: dict[str, tuple[Bundle, Verdict]]) -> None:
    _, verdict = _need(verdicts, kind, tmp_path)
    assert verdict.kind is VerdictKind.GIL_CYCLE
    assert "PagePool::alloc_page" in verdict.summary and "std::" not in verdict.summary.split(";")[0]


def test_asyncio_parked_loop_names_the_read_and_its_peer(
        tmp_path: Path, verdicts: dict[str, tuple[Bundle, Verdict]]) -> None:
    bundle, verdict = _need(verdicts, "ipc_read_asyncio", tmp_path)
    assert verdict.kind is VerdictKind.BLOCKED_IPC_READ
    assert "asyncio event loop" in verdict.summary and "no timeout" in verdict.summary
    assert "tcp socket" in verdict.summary and "peer: pid" in verdict.summary


def test_python_lock_inversion_says_holders_are_inferred(
        tmp_path: Path, verdicts: dict[str, tuple[Bundle, Verdict]]) -> None:
    _, verdict = _need(verdicts, "lock_inversion_py2", tmp_path)
    assert verdict.kind is VerdictKind.LOCK_ORDER_INVERSION
    assert "inferred" in verdict.summary and verdict.confidence.value != "high"
    assert {e.tid for e in verdict.evidence} and len(verdict.evidence) == 2


def test_progressing_programs_carry_progress_evidence(
        tmp_path: Path, verdicts: dict[str, tuple[Bundle, Verdict]]) -> None:
    bundle, verdict = _need(verdicts, "slow_start_logging", tmp_path)
    proc = bundle.processes[0]
    assert proc.progress is not None and any(n > 0 for n in proc.progress.log_growth.values())
    assert any(f.kind == "progress" for f in verdict.findings)


@pytest.mark.parametrize("kind,code,word", [("gil_held_queue", 10, "gil_held_blocked"), ("stopped", 5, "stopped"),
                                             ("crash_segfault", 4, "crash"), ("healthy_timed_signaller", 0, "healthy")])
def test_cli_capture_exit_codes(kind: str, code: int, word: str, tmp_path: Path) -> None:
    why = hk.available(kind)
    if why is not None:
        pytest.skip(why)
    with hk.running(kind, bound_s=90) as h:
        before = Path(f"/proc/{h.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        done = run_kvdiag("capture", "--pid", str(h.root_pid), "--out", str(tmp_path / "run"), "--tools",
                          "proc,py-spy", timeout=120)
        rc, out = done.returncode, done.stdout + done.stderr
        after = Path(f"/proc/{h.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert rc == code, out
    assert f"verdict: {word}" in out
    assert before == after          # a stopped target stays stopped, a running one keeps running


@pytest.mark.parametrize("kind", ["stopped", "traced"])
def test_stopped_or_traced_captured_without_proc_is_never_healthy(kind: str, tmp_path: Path) -> None:
    """A real capture without the /proc backend: the preflight's reading of the target as found (its
    state, its tracer) still says it cannot be judged; a traced target's tools are refused outright."""
    with hk.running(kind, bound_s=90) as h:
        bundle = capture_tree(h.root_pid, tmp_path / "bundle", timeout_s=10.0, backends=["py-spy", "pystack", "gdb"])
    assert all(t.tool != "proc" for p in bundle.processes for t in p.tools)
    verdict = analyze(bundle)
    assert verdict.kind.value == kind and exit_code_for(verdict) == 5, verdict.summary


@pytest.mark.parametrize("kind", ["ipc_read_http_client", "ipc_read_socketpair", "healthy_http_keepalive"])
def test_service_shapes_without_proc_are_never_a_false_deadlock_or_a_missed_one(kind: str, tmp_path: Path) -> None:
    """Without /proc, a client's reply wait is judged only when its frames say so (http.client); a read
    whose role the frames do not show is inconclusive (exit 6); an idle http.server stays healthy."""
    with hk.running(kind, bound_s=90) as h:
        bundle = capture_tree(h.root_pid, tmp_path / "bundle", timeout_s=10.0, backends=["py-spy", "pystack"])
    verdict = analyze(bundle)
    expect = {"ipc_read_http_client": "blocked_ipc_read", "ipc_read_socketpair": "inconclusive",
              "healthy_http_keepalive": "healthy"}[kind]
    assert verdict.kind.value == expect, verdict.summary
    if expect == "inconclusive":
        assert exit_code_for(verdict) == 6 and "/proc was not read" in verdict.summary


@pytest.mark.parametrize("kind,n", [("lock_inversion_py2", 2), ("lock_inversion_py3", 3)])
def test_pystack_lock_locals_name_each_python_lock_holder(kind: str, n: int, tmp_path: Path) -> None:
    """`pystack-locals`: pystack --locals, only lock objects kept. Each waiter's lock is referenced by exactly
    one other thread that does not wait for it: the holders close a cycle, drawn lock by lock; nothing but
    lock-typed locals reaches the raw output."""
    with hk.running(kind, bound_s=90) as h:
        bundle = capture_tree(h.root_pid, tmp_path / "bundle", timeout_s=10.0,
                              backends=["proc", "py-spy", "pystack-locals"])
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.LOCK_ORDER_INVERSION and verdict.confidence.value == "medium"
    assert "referenced" in " ".join(verdict.cycle) and len([c for c in verdict.cycle if "Python lock" in c]) == n
    raw = "".join(p.read_text() for p in (tmp_path / "bundle").rglob("pystack.txt"))
    assert "Arguments:" in raw and "<Thread at" not in raw
    entries = [ln for ln in raw.splitlines() if re.match(r"^\s+[A-Za-z_]\w*: <", ln)]
    assert entries and all(re.search(r": <(_thread\.)?(lock|RLock) at 0x[0-9a-f]+>$", ln) for ln in entries), entries
