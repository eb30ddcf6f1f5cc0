"""Capture without ptrace: real programs started with KVDIAG_AGENT=1, read through kvdiag's in-process agent.

The GIL cycle is captured from a kvdiag that runs under a seccomp filter refusing ptrace and
process_vm_readv (tests/fixtures/no_ptrace.py, a container without SYS_PTRACE): the verdict, its holder
and its waiter come through the agent alone. The safety tests dump live programs many times in a row,
while they fork, while they exit and while they are stopped: the target keeps running and serving, and
every wait is bounded.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvdiag.agent.protocol import DIR_ENV, ENABLE_ENV, ArmedRecord
from kvdiag.analyze.overall import analyze
from kvdiag.capture.agent import Armed, armed, parse_dump, request_dump
from kvdiag.capture.bundle import capture_tree
from kvdiag.model.kinds import GilState, VerdictKind

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES / "hangers"))
import hanger_kit as hk  # noqa: E402

pytestmark = pytest.mark.timeout(120)
AGENT_ENV = {**os.environ, ENABLE_ENV: "1"}


def _wait_armed(pid: int, timeout_s: float = 20.0) -> Armed:
    deadline = time.monotonic() + timeout_s
    why = ""
    while time.monotonic() < deadline:
        arm, why = armed(pid)
        if arm is not None:
            return arm
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} never armed: {why}")


def test_gil_cycle_named_through_the_agent_alone_under_a_seccomp_filter(tmp_path: Path) -> None:
    with hk.running("gil_cycle", env=AGENT_ENV) as h:
        env = {k: v for k, v in os.environ.items() if k != ENABLE_ENV}
        r = subprocess.run([sys.executable, str(FIXTURES / "no_ptrace.py"), str(Path(sys.executable).parent / "kvdiag"),
                            "capture", "--pid", str(h.pid), "--json", "--out", str(tmp_path / "out")],
                           capture_output=True, text=True, timeout=90, env=env)
    assert r.returncode == 10, r.stderr[-3000:]
    assert f"pid {h.pid}: read through kvdiag's in-process agent (ptrace refused" in r.stderr
    verdict = json.loads(r.stdout)["verdict"]
    assert verdict["kind"] == "gil_cycle", verdict
    roles = {e["tid"]: e["role"] for e in verdict["evidence"]}
    assert roles.get(h.pid, "").startswith("alloc_page caller (holds the GIL"), roles
    assert any("map_pages (waits for the GIL)" in role for tid, role in roles.items() if tid != h.pid), roles
    bundle = json.loads((tmp_path / "out" / "bundle" / "bundle.json").read_text())
    (proc,) = [p for p in bundle["processes"] if p["pid"] == h.pid]
    tools = {t["tool"]: t for t in proc["tools"]}
    assert tools["agent"]["ok"] and tools["pystack"]["skipped"] and tools["gdb"]["skipped"], tools
    assert tools["proc"]["ok"], tools     # /proc needs no ptrace: its readings join the agent's
    holder = next(t for t in proc["threads"] if t["tid"] == h.pid)
    assert holder["gil_by_tool"]["agent"] == GilState.HOLDS.value
    assert any(f["name"] == "alloc_page" for f in holder["frames_by_tool"]["agent"])


def test_via_agent_reads_the_same_threads_as_pystack(tmp_path: Path) -> None:
    # Python locks: the rule asks whether a signal handler could end the wait; the agent's own two signals
    # must not count as one on either path.
    with hk.running("lock_inversion_py2", env=AGENT_ENV) as h:
        _wait_armed(h.pid)
        agent = capture_tree(h.root_pid, tmp_path / "a", backends=["proc", "agent"], save=False)
        ptrace = capture_tree(h.root_pid, tmp_path / "p", backends=["proc", "pystack"], save=False)
    assert analyze(agent).kind is analyze(ptrace).kind is VerdictKind.LOCK_ORDER_INVERSION
    read = {t.tid for p in agent.processes for t in p.threads if t.frames_by_tool.get("agent")}
    assert read == {t.tid for p in ptrace.processes for t in p.threads if t.frames_by_tool.get("pystack")}


_SERVER = textwrap.dedent("""
    import os, signal, socket, sys, threading, time
    n = int(sys.argv[1])
    def busy():
        x = 0
        while True:
            x += 1
    for _ in range(n):
        threading.Thread(target=busy, daemon=True).start()
    def masked():
        # as native worker pools do: every signal blocked in this thread; the agent must not wait for it
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        time.sleep(3600)
    threading.Thread(target=masked, daemon=True).start()
    srv = socket.create_server(("127.0.0.1", 0))
    def serve():
        while True:
            conn, _ = srv.accept()
            with conn:
                conn.sendall(conn.recv(64))
    threading.Thread(target=serve, daemon=True).start()
    if len(sys.argv) > 2 and sys.argv[2] == "fork":
        def forker():
            while True:
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
                os.waitpid(pid, 0)
        threading.Thread(target=forker, daemon=True).start()
    print(srv.getsockname()[1], flush=True)
    time.sleep(float(os.environ.get("KVDIAG_TEST_BOUND", "90")))
""")


@contextmanager
def _server(*args: str, bound_s: float = 90.0) -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, *args], stdout=subprocess.PIPE, text=True,
                            env={**AGENT_ENV, "KVDIAG_TEST_BOUND": str(bound_s)}, start_new_session=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _echo(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"ping")
        return s.recv(64)


def test_a_thousand_dumps_leave_the_target_running_and_serving() -> None:
    with _server("2") as (proc, port):
        arm = _wait_armed(proc.pid)
        start = time.monotonic()
        for i in range(1000):
            out = request_dump(proc.pid, arm, 5.0)
            assert out.text is not None, (i, out.error)
        per_dump = (time.monotonic() - start) / 1000
        dump = parse_dump(out.text)
        assert dump is not None and dump.complete and len(dump.threads) >= 5
        # the thread that blocks every signal is named as such, not waited for (a busy thread the scheduler kept
        # off a loaded CPU for the whole 300 ms may still miss a dump: "noanswer")
        assert out.text.count(" blocked\n") == 1
        assert proc.poll() is None and _echo(port) == b"ping"
        leftovers = [p.name for p in arm.directory.glob(f"{proc.pid}.*") if not p.name.endswith(".armed")]
        assert leftovers == []
    assert per_dump < 0.1, f"{per_dump * 1000:.1f} ms per dump"


def test_dumps_while_the_target_forks_harm_nothing() -> None:
    with _server("1", "fork") as (proc, port):
        arm = _wait_armed(proc.pid)
        answered = sum(request_dump(proc.pid, arm, 5.0).text is not None for _ in range(200))
        assert answered == 200
        assert proc.poll() is None and _echo(port) == b"ping"


def test_dump_of_a_stopped_then_exiting_target_is_bounded() -> None:
    with _server("1", bound_s=3.0) as (proc, port):
        arm = _wait_armed(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            out = request_dump(proc.pid, arm, 2.0)
            assert out.text is None and "stopped" in (out.error or "") and time.monotonic() - t0 < 1.0
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert _echo(port) == b"ping"
        # It exits (its bound) while being asked over and over: each answer or refusal is bounded.
        outcomes = []
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            t0 = time.monotonic()
            out = request_dump(proc.pid, arm, 2.0)
            assert time.monotonic() - t0 < 2.5
            outcomes.append(out.text is not None)
        assert proc.wait(timeout=10) == 0     # it exited on its own, normally
        assert any(outcomes)
        assert not (arm.directory / f"{proc.pid}.armed").exists()


_ATTACH_TIME = """
import json, sys
from pathlib import Path
import kvdiag.capture.agent as agent
from kvdiag.analyze.overall import analyze
from kvdiag.capture.bundle import capture_tree
# As under an LSM that refuses the attach itself: kvdiag cannot tell beforehand (its probe says ptrace is allowed).
agent.ptrace_refused_here = lambda: False
bundle = capture_tree(int(sys.argv[1]), Path(sys.argv[2]), save=False)
tools = {t.tool: (t.ok, t.error) for p in bundle.processes for t in p.tools}
print(json.dumps({"kind": analyze(bundle).kind.value, "tools": tools,
                  "paths": [f.message for f in bundle.findings if f.kind == "capture_path"]}))
"""


def test_agent_after_the_kernel_refused_every_attach(tmp_path: Path) -> None:
    with hk.running("gil_cycle_native", env=AGENT_ENV) as h:
        _wait_armed(h.pid)
        env = {k: v for k, v in os.environ.items() if k != ENABLE_ENV}
        r = subprocess.run([sys.executable, str(FIXTURES / "no_ptrace.py"), sys.executable, "-c", _ATTACH_TIME,
                            str(h.pid), str(tmp_path / "b")], capture_output=True, text=True, timeout=90, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["kind"] == "gil_cycle", got
    assert got["tools"]["agent"][0] and not got["tools"]["pystack"][0], got["tools"]
    assert any("refused every ptrace tool's attach" in p for p in got["paths"]), got["paths"]


_PARKED = "import sys, time; print('up', flush=True); time.sleep(float(sys.argv[1]))"


@contextmanager
def _parked(env: dict[str, str], bound_s: float = 60.0) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _PARKED, str(bound_s)], stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_a_record_left_by_a_target_killed_with_sigkill_is_ignored_and_removed(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "agent"
    monkeypatch.setenv(DIR_ENV, str(directory))
    env = {**AGENT_ENV, DIR_ENV: str(directory)}
    gone, gone2 = subprocess.Popen(["true"]), subprocess.Popen(["true"])
    gone.wait(timeout=10)
    gone2.wait(timeout=10)
    with _parked(env) as live, _parked(env) as victim, _parked({**os.environ, DIR_ENV: str(directory)}) as plain:
        _wait_armed(live.pid)
        arm = _wait_armed(victim.pid)
        assert arm.directory == directory
        # What kvdiag did not write stays, whoever's pid it names: a note, a link, a record-named file of
        # another format, a record that names another pid.
        foreign = {"notes.txt": "mine", f"{gone.pid}.armed": "not a record\n",
                   f"{gone2.pid}.armed": ArmedRecord(gone.pid, 1, 40, 41, "3").render()}
        for name, text in foreign.items():
            (directory / name).write_text(text)
        os.symlink(directory / "notes.txt", directory / f"{gone.pid}.7.dump")
        # A record for a live pid with another start time: that pid was reused since the record was written.
        reused = directory / f"{plain.pid}.armed"
        reused.write_text(ArmedRecord(plain.pid, 1, arm.record.trigger, arm.record.thread, "3").render())
        (directory / f"{victim.pid}.5.tmp").write_text("a dump cut short")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        record = directory / f"{victim.pid}.armed"
        assert record.exists()        # SIGKILL: the agent had no chance to remove it
        got, why = armed(victim.pid)
        assert got is None and "gone" in why
        assert not record.exists() and not (directory / f"{victim.pid}.5.tmp").exists() and not reused.exists()
        reused.write_text(ArmedRecord(plain.pid, 1, arm.record.trigger, arm.record.thread, "3").render())
        got, why = armed(plain.pid)
        assert got is None and "earlier process" in why and not reused.exists()
        assert armed(live.pid)[0] is not None and (directory / f"{live.pid}.armed").exists()
        assert {p.name for p in directory.iterdir()} == {*foreign, f"{gone.pid}.7.dump", f"{live.pid}.armed"}


_NODE = """
import json, sys
from pathlib import Path
from kvdiag.analyze.overall import analyze
from kvdiag.bundle.io import load_bundle
from kvdiag.capture.orchestrate import DEFAULT_BACKENDS
from kvdiag.runs.fleet.node import capture_on_node
from kvdiag.runs.fleet.pack import unpack_dir
out = capture_on_node([int(sys.argv[1])], 10.0, list(DEFAULT_BACKENDS), "test")
unpack_dir(out["pack"], Path(sys.argv[2]))
bundle, _ = load_bundle(Path(sys.argv[2]))
print(json.dumps({"kind": analyze(bundle).kind.value,
                  "paths": [f.message for f in bundle.findings if f.kind == "capture_path"]}))
"""


def test_a_fleet_node_capture_reads_an_armed_process_through_the_agent(tmp_path: Path) -> None:
    # What a fleet capture runs on each node (capture_on_node), on a node where ptrace is refused.
    with hk.running("gil_cycle", env=AGENT_ENV) as h:
        _wait_armed(h.pid)
        env = {k: v for k, v in os.environ.items() if k != ENABLE_ENV}
        r = subprocess.run([sys.executable, str(FIXTURES / "no_ptrace.py"), sys.executable, "-c", _NODE, str(h.pid),
                            str(tmp_path / "node")], capture_output=True, text=True, timeout=90, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["kind"] == "gil_cycle", got
    assert any(p.startswith(f"pid {h.pid}: read through kvdiag's in-process agent") for p in got["paths"]), got


_SLEEPERS = """
import ctypes, sys, threading, time
libc = ctypes.CDLL(None)
ids = []
def csleep():
    ids.append(threading.get_native_id())
    libc.sleep(60)
    print("woke", flush=True)
def timed():
    ids.append(threading.get_native_id())
    c = threading.Condition()
    with c:
        c.wait(60)
threading.Thread(target=csleep, daemon=True).start()
time.sleep(0.2)
threading.Thread(target=timed, daemon=True).start()
time.sleep(0.2)
print(*ids, flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_a_sleep_resumed_after_a_stop_is_not_woken_and_a_timed_wait_is_read() -> None:
    # After SIGSTOP/SIGCONT (or a debugger) both a C sleep() and a timed futex wait sit in restart_syscall:
    # a handler would end the sleep early, while a timed wait (a GIL waiter's) must still be read.
    proc = subprocess.Popen([sys.executable, "-c", _SLEEPERS, "30"], stdout=subprocess.PIPE, text=True,
                            env=AGENT_ENV, start_new_session=True)
    try:
        assert proc.stdout is not None
        sleeper, waiter = map(int, proc.stdout.readline().split())
        arm = _wait_armed(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.2)
        out = request_dump(proc.pid, arm, 5.0)
        assert out.text is not None, out.error
        dump = parse_dump(out.text)
        assert dump is not None
        states = {t.tid: t.state for t in dump.threads}
        # the waiter is signalled (a thread kept off a loaded CPU past the 300 ms collect may miss it: noanswer)
        assert states[sleeper] == "asleep" and states[waiter] in ("answered", "noanswer"), states
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        assert not ready, "the C sleep() ended early"
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
