"""Capture never leaves a target stopped, with real ptrace.

A debugger killed mid-attach leaves its target stopped once the kernel detaches it (the SIGSTOP
of PTRACE_ATTACH is delivered after all). ``hung_attacher.py`` is such a debugger: a real
process that attaches to every thread and never waits; the capture's tool timeout kills it. Real
gdb, killed by tiny timeouts at whatever point it has reached, must leave nothing stopped either.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from procs import wait_for

from kvdiag.capture.base import BackendResult, failed_run, run_tool
from kvdiag.capture.orchestrate import capture_processes
from kvdiag.capture.tools import GdbBackend
from kvdiag.model.evidence import ToolRun

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ATTACHER = FIXTURES / "tools" / "hung_attacher.py"
RECORDER = FIXTURES / "tools" / "signal_recorder.py"
sys.path.insert(0, str(FIXTURES / "hangers"))
import hanger_kit as hk  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def states(pid: int) -> tuple[str, int, set[str]]:
    """(process state letter, TracerPid, the set of its threads' state letters) from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":" in line)
    threads = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            threads.add(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue
    return fields["State"].strip()[0], int(fields["TracerPid"].strip()), threads


def stopped(pid: int) -> bool:
    state, _, threads = states(pid)
    return state in "Tt" or bool(threads & {"T", "t"})



class HungAttacher:
    """A ptrace-based capture backend whose tool hangs right after attaching (killed by the timeout)."""

    name = "hung-attacher"
    stops_target = True

    def available(self) -> str | None:
        return None

    def capture(self, pid: int, timeout_s: float, raw_dir: Path) -> BackendResult:
        argv = [sys.executable, str(ATTACHER), str(pid)]
        outcome = run_tool(argv, timeout_s)
        return BackendResult(tool=failed_run(self.name, argv, outcome, timeout_s, None))


@pytest.fixture
def target() -> Iterator[int]:
    with hk.running("healthy_idle", bound_s=150) as h:
        try:
            yield h.pid
        finally:
            try:
                os.kill(h.pid, signal.SIGCONT)   # whatever a failed test left, teardown can kill it
            except ProcessLookupError:
                pass


def test_the_attacher_really_leaves_its_target_stopped(target: int) -> None:
    """The premise: without kvdiag's check, a debugger killed mid-attach leaves the target stopped."""
    out = run_tool([sys.executable, str(ATTACHER), str(target)], timeout_s=1.5)
    assert out.timed_out and "attached" in out.stdout, out
    assert wait_for(lambda: stopped(target)), states(target)
    os.kill(target, signal.SIGCONT)
    assert wait_for(lambda: not stopped(target))


def test_a_debugger_killed_mid_attach_leaves_no_stopped_target(target: int, tmp_path: Path) -> None:
    evidence, findings = capture_processes([target], tmp_path / "raw", timeout_s=3.0,
                                           backends=["proc", HungAttacher()])
    state, tracer, threads = states(target)
    assert not stopped(target) and tracer == 0, (state, threads)
    left = [f for f in findings if f.kind == "capture_left_stopped"]
    assert len(left) == 1 and left[0].pid == target, findings
    assert "resumed it with SIGCONT" in left[0].message
    tool = next(t for t in evidence[0].tools if t.tool == "hung-attacher")
    assert not tool.ok and "timed out" in (tool.error or "")


def test_every_ptrace_tool_is_checked_not_only_the_last(target: int, tmp_path: Path) -> None:
    """Killed mid-attach as the first tool of the chain: resumed before the next tool runs."""
    seen: list[bool] = []

    class Probe:
        name = "probe"
        stops_target = True

        def available(self) -> str | None:
            return None

        def capture(self, pid: int, timeout_s: float, raw_dir: Path) -> BackendResult:
            seen.append(stopped(pid))
            return BackendResult(tool=ToolRun(tool=self.name, ok=True))

    _, findings = capture_processes([target], tmp_path / "raw", timeout_s=6.0,
                                    backends=[HungAttacher(), Probe()])
    assert seen == [False], "the next tool found the target still stopped"
    assert [f.kind for f in findings].count("capture_left_stopped") == 1
    assert not stopped(target)


def test_a_target_stopped_when_found_is_left_as_found(tmp_path: Path) -> None:
    """Stopped before kvdiag came: left stopped, and kvdiag sends it no SIGCONT (the target records
    every SIGCONT it gets)."""
    log = tmp_path / "signals.log"
    proc = subprocess.Popen([sys.executable, str(RECORDER), str(log), "120"], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"READY"
        target = proc.pid
        os.kill(target, signal.SIGSTOP)
        assert wait_for(lambda: stopped(target))
        _, findings = capture_processes([target], tmp_path / "raw", timeout_s=2.0,
                                        backends=["proc", HungAttacher()])
        assert wait_for(lambda: states(target)[1] == 0)     # the killed attacher is gone
        assert stopped(target), (states(target), findings)
        assert not [f for f in findings if f.kind == "capture_left_stopped"], findings
        assert "SIGCONT" not in (log.read_text() if log.exists() else ""), "kvdiag resumed it"
    finally:
        proc.kill()
        proc.wait(timeout=10)


class _Interrupt(BaseException):
    pass


def test_an_interrupted_capture_resumes_the_target(target: int, tmp_path: Path) -> None:
    """Ctrl-C while the debugger is attached: the tool is killed and the target resumed."""
    def on_usr1(signum: int, frame: FrameType | None) -> None:
        raise _Interrupt()

    def fire_once_attached() -> None:
        if wait_for(lambda: states(target)[1] != 0, bound_s=30):
            os.kill(os.getpid(), signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, on_usr1)
    th = threading.Thread(target=fire_once_attached, daemon=True)
    try:
        th.start()
        with pytest.raises(_Interrupt) as info:
            capture_processes([target], tmp_path / "raw", timeout_s=30.0, backends=[HungAttacher()])
    finally:
        signal.signal(signal.SIGUSR1, old)
        th.join(timeout=35)
    assert not stopped(target) and states(target)[1] == 0, states(target)
    found = getattr(info.value, "capture_findings", [])
    assert [f.kind for f in found] == ["capture_left_stopped"], found


def test_real_gdb_killed_at_any_point_leaves_nothing_stopped(target: int, tmp_path: Path) -> None:
    if GdbBackend().available() is not None:
        pytest.fail("gdb is required for this test (apt-get install gdb)")
    for i, timeout_s in enumerate((0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2)):
        capture_processes([target], tmp_path / f"raw{i}", timeout_s=timeout_s, backends=["gdb"])
        state, tracer, threads = states(target)
        assert not stopped(target) and tracer == 0, (timeout_s, state, tracer, threads)
    # still alive and answering: the gdb runs did not hurt it
    assert subprocess.run(["kill", "-0", str(target)]).returncode == 0
