"""Live capture against real hanging programs (tests/fixtures/hangers): verdicts, bounds, read-only."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from kvdiag.analyze.overall import analyze
from kvdiag.bundle.io import raw_root
from kvdiag.capture.discover import find_engine_processes
from kvdiag.capture.orchestrate import CAPTURE_SLACK_S, capture_processes
from kvdiag.capture.tools import PystackBackend
from kvdiag.cli.main import main as kvdiag_main
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import ProcessRole, VerdictKind
from kvdiag.osread.ptable import process_tree

HANGERS = Path(__file__).resolve().parents[1] / "fixtures" / "hangers"
sys.path.insert(0, str(HANGERS))
import hanger_kit as hk  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def observe(pid: int) -> tuple[str, int, list[int]]:
    """(state letter, TracerPid, sorted tids) straight from /proc."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    return fields["State"].strip()[0], int(fields["TracerPid"].strip()), tids


def cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = kvdiag_main(list(argv))
    return code, out.getvalue() + err.getvalue()


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hanger-build")


@pytest.fixture
def gil_tree(build_dir: Path) -> Iterator[hk.Hanger]:
    with hk.running("gil_cycle", build_dir=build_dir, under_parent=True, title="VLLM::EngineCore", bound_s=90) as h:
        yield h


def test_capture_gil_cycle_tree_is_read_only_and_finds_the_cycle(gil_tree: hk.Hanger, tmp_path: Path) -> None:
    pids = process_tree(gil_tree.root_pid)
    before = {pid: observe(pid) for pid in pids}
    evidence, findings = capture_processes(pids, raw_root(tmp_path), timeout_s=10, bundle_dir=tmp_path)
    after = {pid: observe(pid) for pid in pids}
    for pid in pids:
        state, tracer, tids = after[pid]
        assert tracer == 0, f"{pid} left traced"
        assert state == before[pid][0] and state != "T"
        assert tids == before[pid][2]
    assert not [f for f in findings if f.kind.startswith("capture_left")]
    # gdb is the fallback: where pystack read every thread's native frames it does not stop the target again
    ran = [(ev, run) for ev in evidence for run in ev.tools
           if not (run.tool == "gdb" and (run.error or "").startswith("gdb skipped: pystack read the native"))]
    assert {run.tool for _, run in ran} == {"proc", "py-spy", "pystack"}
    assert all(run.ok for _, run in ran), [r.error for _, r in ran]
    assert all(run.raw_path and not os.path.isabs(run.raw_path) and (tmp_path / run.raw_path).is_file()
               for _, run in ran)
    # the bundle's one raw layout (kvdiag.bundle.io.raw_dir): raw/<pid>/<tool>.txt
    assert all(Path(run.raw_path or "").parts[:2] == ("raw", str(ev.pid)) for ev, run in ran)
    for ev in evidence:
        tools = {run.tool: run for run in ev.tools}
        # py-spy reads Python frames inside the /proc window without pausing; pystack waits for the window
        assert "--nonblocking" in tools["py-spy"].command
        assert ev.progress is not None and tools["proc"].started_s is not None
        window_end = tools["proc"].started_s + ev.progress.window_s
        assert tools["pystack"].started_s is not None and tools["pystack"].started_s >= window_end - 0.005
    verdict = analyze(Bundle(processes=evidence, findings=findings))
    assert verdict.kind is VerdictKind.GIL_CYCLE
    assert verdict.evidence[0].pid == gil_tree.pid


def test_find_engine_processes_never_picks_the_api_server(gil_tree: hk.Hanger) -> None:
    roles = find_engine_processes(gil_tree.root_pid)
    assert roles[ProcessRole.ENGINE_CORE] == [gil_tree.pid]
    assert roles[ProcessRole.API_SERVER] == [gil_tree.root_pid]
    # even when a log line (wrongly) names the API server's pid as the engine core
    roles = find_engine_processes(gil_tree.root_pid, {"engine_core": gil_tree.root_pid})
    assert gil_tree.root_pid not in roles.get(ProcessRole.ENGINE_CORE, [])


def test_cli_capture_says_gil_cycle_and_exits_10(gil_tree: hk.Hanger, tmp_path: Path) -> None:
    code, out = cli("capture", "--pid", str(gil_tree.root_pid), "--out", str(tmp_path / "run"))
    assert code == 10, out
    assert "verdict: gil_cycle" in out and "alloc_page" in out and "map_pages" in out
    data = json.loads((tmp_path / "run" / "bundle" / "bundle.json").read_text())
    assert {p["role"] for p in data["processes"]} == {"api_server", "engine_core"}
    code, out = cli("analyze", str(tmp_path / "run"), "--json")
    assert code == 10 and json.loads(out)["verdict"]["kind"] == "gil_cycle"


def test_cli_capture_healthy_busy_exits_0(build_dir: Path, tmp_path: Path) -> None:
    with hk.running("healthy_busy", build_dir=build_dir, bound_s=60) as h:
        code, out = cli("capture", "--pid", str(h.pid), "--out", str(tmp_path / "run"), "--timeout", "8")
    assert code == 0, out
    assert "verdict: healthy" in out


def test_cli_capture_bad_pid_is_usage_error() -> None:
    code, out = cli("capture", "--pid", "999999999")
    assert code == 2 and "no such process" in out and "Traceback" not in out


def test_stopped_target_stays_stopped_and_capture_is_bounded(build_dir: Path, tmp_path: Path) -> None:
    with hk.running("gil_cycle", build_dir=build_dir, bound_s=60) as h:
        os.kill(h.pid, signal.SIGSTOP)
        try:
            time.sleep(0.1)
            before = observe(h.pid)
            assert before[0] == "T"
            timeout = 5.0
            start = time.monotonic()
            evidence, findings = capture_processes([h.pid], tmp_path / "raw", timeout_s=timeout)
            elapsed = time.monotonic() - start
            after = observe(h.pid)
        finally:
            os.kill(h.pid, signal.SIGCONT)
    assert elapsed <= timeout + CAPTURE_SLACK_S
    assert after == before            # still stopped, not traced, same threads: we did not resume it
    tools = {r.tool: r for r in evidence[0].tools}
    assert tools["proc"].ok and tools["pystack"].ok
    # any tool that could not read the stopped process says so in a finding
    for run in evidence[0].tools:
        if not run.ok and not (run.error or "").startswith("gdb skipped: pystack read the native"):
            assert any(run.tool in f.message for f in findings if f.kind in ("tool_failed", "tool_timeout"))
    verdict = analyze(Bundle(processes=evidence, findings=findings))
    # A stopped target gets its own outcome (exit 5, not 10); the cycle its stacks show is named too.
    assert verdict.kind is VerdictKind.STOPPED, verdict.summary
    assert "gil_cycle" in verdict.summary and any(f.kind == "mechanism" for f in verdict.findings)


def test_hanging_tool_is_killed_and_reported(build_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_bin, marker = fake_hung_gdb(tmp_path, "inproc")
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    with hk.running("gil_cycle", build_dir=build_dir, bound_s=60) as h:
        before = observe(h.pid)
        timeout = 4.0
        start = time.monotonic()
        # pystack without native frames: gdb (hung here) is the one to read them
        backends = ["proc", "py-spy", PystackBackend(native=False), "gdb"]
        evidence, findings = capture_processes([h.pid], tmp_path / "raw", timeout_s=timeout, backends=backends)
        elapsed = time.monotonic() - start
        after = observe(h.pid)
    assert elapsed <= timeout + CAPTURE_SLACK_S
    assert after == before
    gdb_run = next(r for r in evidence[0].tools if r.tool == "gdb")
    assert not gdb_run.ok and gdb_run.error and "gdb timed out after" in gdb_run.error
    assert any(f.kind == "tool_timeout" and "gdb timed out" in f.message for f in findings)
    leftovers = [p for p in os.listdir("/proc") if p.isdigit() and marker in _cmdline(int(p))]
    assert not leftovers, "the hung tool's process group must be gone"
    # the other tools still delivered: the verdict stands
    assert analyze(Bundle(processes=evidence, findings=findings)).kind is VerdictKind.GIL_CYCLE


def fake_hung_gdb(tmp_path: Path, tag: str) -> tuple[Path, str]:
    """A `gdb` that never returns: it execs a uniquely named `sleep`, so leftovers can be found."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    marker = f"kvdiag-fake-gdb-{os.getpid()}-{tag}"
    sleeper = fake_bin / marker
    sleeper.symlink_to(shutil.which("sleep") or "/bin/sleep")
    gdb = fake_bin / "gdb"
    gdb.write_text(f"#!/bin/sh\nexec {sleeper} 600\n")
    gdb.chmod(gdb.stat().st_mode | stat.S_IXUSR)
    return fake_bin, marker


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_missing_pystack_is_a_finding_not_a_crash(build_dir: Path, tmp_path: Path) -> None:
    backends = ["proc", "py-spy", PystackBackend(binary=str(tmp_path / "no-such-pystack")), "gdb"]
    with hk.running("gil_cycle_native", build_dir=build_dir, bound_s=60) as h:
        evidence, findings = capture_processes([h.pid], tmp_path / "raw", timeout_s=10, backends=backends)
    assert any(f.kind == "tool_missing" and "pystack" in f.message for f in findings)
    run = next(r for r in evidence[0].tools if r.tool == "pystack")
    assert not run.ok and run.error and "not installed" in run.error
    assert analyze(Bundle(processes=evidence, findings=findings)).kind is VerdictKind.GIL_CYCLE


def test_uninterruptible_thread_does_not_hang_capture(build_dir: Path, tmp_path: Path) -> None:
    """A thread in state D (vfork parent) cannot be ptrace-stopped: the tools are killed at the bound."""
    with hk.running("dstate", build_dir=build_dir, bound_s=60) as h:
        timeout = 5.0
        start = time.monotonic()
        evidence, findings = capture_processes([h.pid], tmp_path / "raw", timeout_s=timeout)
        elapsed = time.monotonic() - start
        state, tracer, _ = observe(h.pid)
    assert elapsed <= timeout + CAPTURE_SLACK_S
    assert tracer == 0 and state != "T"
    assert any(f.kind == "target_uninterruptible" for f in findings)
    for run in evidence[0].tools:
        if not run.ok:   # whatever could not be read is named, with the reason
            assert run.error and any(run.tool in f.message for f in findings)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_kvdiag_mid_capture_leaves_no_tool_behind(sig: signal.Signals, build_dir: Path,
                                                          tmp_path: Path) -> None:
    """A hung gdb must not outlive kvdiag, however kvdiag dies (TERM: handled; KILL: PDEATHSIG)."""
    import subprocess

    fake_bin, marker = fake_hung_gdb(tmp_path, sig.name)
    env = dict(os.environ, PATH=f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    with hk.running("gil_cycle", build_dir=build_dir, bound_s=60) as h:
        before = observe(h.pid)
        proc = subprocess.Popen([sys.executable, "-m", "kvdiag", "capture", "--pid", str(h.pid), "--timeout", "60",
                                 "--tools", "proc,py-spy,gdb", "--out", str(tmp_path / "run")], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not _with_marker(marker):
                time.sleep(0.05)
            assert _with_marker(marker), "the fake gdb never started"
            proc.send_signal(sig)
            proc.wait(timeout=20)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _with_marker(marker):
            time.sleep(0.05)
        after = observe(h.pid)
    assert not _with_marker(marker)
    assert after == before
    if sig is signal.SIGTERM:
        assert proc.returncode == 130


def _with_marker(marker: str) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()
            and marker in _cmdline(int(p))]


def test_capture_bound_and_verdict_hold_under_2x_cpu_oversubscription(build_dir: Path, tmp_path: Path) -> None:
    """Busy neighbours (two CPU burners per core) slow every tool down; capture must still end within
    its bound, leave the target as found, and not mistake a starved deadlock for progress."""
    burn = "import signal\nsignal.alarm(90)\nwhile True:\n    pass\n"
    burners = [subprocess.Popen([sys.executable, "-c", burn], start_new_session=True)
               for _ in range(2 * (os.cpu_count() or 1))]
    try:
        with hk.running("gil_cycle", build_dir=build_dir, bound_s=90) as h:
            before = observe(h.pid)
            timeout = 6.0
            start = time.monotonic()
            evidence, findings = capture_processes([h.pid], tmp_path / "raw", timeout_s=timeout)
            elapsed = time.monotonic() - start
            after = observe(h.pid)
    finally:
        for b in burners:
            b.kill()
            b.wait(timeout=10)
    assert elapsed <= timeout + CAPTURE_SLACK_S
    assert after == before and after[1] == 0
    assert not [f for f in findings if f.kind.startswith("capture_left")]
    assert analyze(Bundle(processes=evidence, findings=findings)).kind is VerdictKind.GIL_CYCLE
