"""No evidence is not health, on real processes.

- a real GIL-cycle hang owned by root, captured by kvdiag running as a second, ordinary user:
  exit 3, ``no_access``, the refusal and the fix named, never ``healthy``; captured by root
  (permitted) the same program is still ``gil_cycle``, exit 10;
- a zombie, a process that exits while it is being captured, ``sleep 1000`` and pid 2 (a kernel
  thread) each get their own outcome (exit 5), none of them healthy or a deadlock;
- the same rule for an engine kvdiag launches (repro): a non-Python engine is ``not_python``.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kvcli import read_report, run_kvdiag

from kvdiag.capture.access import check_target, is_kernel_thread

ROOT = Path(__file__).resolve().parents[2]
HANGERS = ROOT / "tests" / "fixtures" / "hangers"
sys.path.insert(0, str(HANGERS))
import hanger_kit as hk  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# A user of this test session alone: a concurrent session (another CI run on the machine) has its own, so
# neither one's cleanup can end the other's processes.
OTHER_USER = f"kvdiag-na-{os.getpid()}"
# kvdiag as the other user: the system interpreter (the venv's lives under /root, which other users
# cannot enter) with this checkout and the venv's packages on its path, the venv's tools on PATH.
SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2]


def _wait_for(cond: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _outcome(out: Path) -> tuple[str, int, dict[str, object]]:
    report = read_report(out)
    verdict = report["verdict"]
    assert isinstance(verdict, dict)
    return str(verdict["kind"]), int(report["exit_code"]), report  # type: ignore[call-overload]


def _assert_no_health_or_deadlock(proc: subprocess.CompletedProcess[str], report: dict[str, object]) -> None:
    assert "verdict: healthy" not in proc.stdout and "verdict: gil_cycle" not in proc.stdout
    kinds = {report["verdict"]["kind"]} | {v["kind"] for v in report["verdicts_by_engine"].values()}  # type: ignore[index, union-attr]
    assert not kinds & {"healthy", "gil_cycle", "lock_order_inversion", "lost_wakeup", "blocked_ipc_read",
                        "decode_stall", "unknown", "slow_start"}, kinds


# ---------------------------------------------------------------- another user


def _other_user_reason() -> str | None:
    if os.geteuid() != 0:
        return "creating a second user and switching to it needs root"
    for tool in ("useradd", "userdel", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not SYSTEM_PYTHON.exists():
        return f"{SYSTEM_PYTHON} (an interpreter other users may run) is missing"
    return None


@pytest.fixture(scope="module")
def other_user() -> Iterator[pwd.struct_passwd]:
    reason = _other_user_reason()
    if reason:
        pytest.skip(reason)
    created = False
    try:
        entry = pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
                       check=True, timeout=60)
        created = True
        entry = pwd.getpwnam(OTHER_USER)
    try:
        yield entry
    finally:
        # Every process of that user was started by these tests: end them by pid, then remove the user.
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.stat(f"/proc/{d}").st_uid == entry.pw_uid:
                        os.kill(int(d), signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    pass
        if created:
            subprocess.run(["userdel", OTHER_USER], check=False, timeout=60)


def _kvdiag_as(user: pwd.struct_passwd, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
           "PYTHONPATH": f"{ROOT}:{SITE}", "PYTHONDONTWRITEBYTECODE": "1"}
    argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
            "--inh-caps=-all", str(SYSTEM_PYTHON), "-m", "kvdiag", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd="/tmp")


@pytest.fixture
def shared_out() -> Iterator[Path]:
    """An output folder both users can write (pytest's tmp_path is root's only)."""
    path = Path(tempfile.mkdtemp(prefix="kvdiag-access-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_another_users_hang_is_no_access_and_the_permitted_capture_is_unchanged(
        other_user: pwd.struct_passwd, shared_out: Path, tmp_path: Path) -> None:
    probe = _kvdiag_as(other_user, "--version")
    if probe.returncode != 0:
        pytest.skip(f"kvdiag does not run under {SYSTEM_PYTHON} as another user: {probe.stderr[-300:]}")
    with hk.running("gil_cycle", build_dir=tmp_path / "build", bound_s=120) as h:
        out = shared_out / "as-other-user"
        start = time.monotonic()
        proc = _kvdiag_as(other_user, "capture", "--pid", str(h.pid), "--out", str(out))
        took = time.monotonic() - start
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "verdict: no_access" in proc.stdout
        kind, code, report = _outcome(out)
        assert (kind, code) == ("no_access", 3)
        _assert_no_health_or_deadlock(proc, report)
        # what was refused and why, and the fix that fits (kvdiag is an ordinary user: sudo)
        assert f"pid {h.pid} belongs to uid 0 and kvdiag runs as uid {other_user.pw_uid}" in proc.stdout
        assert f'sudo env "PATH=$PATH" kvdiag capture --pid {h.pid}' in proc.stdout
        kinds = [f["kind"] for f in report["findings"]]  # type: ignore[union-attr, index]
        assert {"access_refused", "access_fix", "partial_evidence"} <= set(kinds)
        bundle = json.loads((out / "bundle" / "bundle.json").read_text())
        target = next(p for p in bundle["processes"] if p["pid"] == h.pid)
        assert target["access"]["ptrace_ok"] is False and target["access"]["uid"] == 0
        # quick: refused before any stack tool attached (they are recorded as skipped)
        assert all("skipped" in (t["error"] or "") for t in target["tools"] if t["tool"] != "proc")
        assert took < 60, took
        # the bundle says the same offline: analyze re-judges it as no_access
        again = run_kvdiag("analyze", str(out), "--json")
        assert again.returncode == 3 and json.loads(again.stdout)["verdict"]["kind"] == "no_access", again.stdout
        # the same program, captured by a user who may read it (root), is unchanged
        permitted = run_kvdiag("capture", "--pid", str(h.pid), "--out", str(tmp_path / "permitted"))
        assert permitted.returncode == 10, permitted.stdout + permitted.stderr
        assert "verdict: gil_cycle" in permitted.stdout
        assert _outcome(tmp_path / "permitted")[:2] == ("gil_cycle", 10)


def test_the_fixes_it_prints_work_on_another_users_hang(other_user: pwd.struct_passwd, shared_out: Path,
                                                        tmp_path: Path) -> None:
    """The hang owned by the ordinary user: root (sudo, the printed fix) and the owner itself (the other
    printed fix) may read it, and see the GIL cycle; the tree of one user is not refused as foreign."""
    probe = _kvdiag_as(other_user, "--version")
    if probe.returncode != 0:
        pytest.skip(f"kvdiag does not run under {SYSTEM_PYTHON} as another user: {probe.stderr[-300:]}")
    build = shared_out / "build"
    build.mkdir()
    build.chmod(0o777)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
           "KVDIAG_HANGER_BUILD_DIR": str(build)}
    hanger = subprocess.Popen(
        ["setpriv", f"--reuid={other_user.pw_uid}", f"--regid={other_user.pw_gid}", "--clear-groups",
         "--inh-caps=-all", str(SYSTEM_PYTHON), str(HANGERS / "gil_cycle.py"), "--python-waiter", "--bound", "150",
         "--build-dir", str(build)],
        cwd=HANGERS, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert hanger.stdout is not None
        line = hanger.stdout.readline()
        assert "READY" in line, line + hanger.stdout.read()[-2000:] if hanger.poll() is not None else line
        hk.settle(hanger.pid)
        assert os.stat(f"/proc/{hanger.pid}").st_uid == other_user.pw_uid
        as_root = run_kvdiag("capture", "--pid", str(hanger.pid), "--out", str(tmp_path / "root"))
        assert as_root.returncode == 10, as_root.stdout + as_root.stderr
        assert _outcome(tmp_path / "root")[:2] == ("gil_cycle", 10)
        out = shared_out / "owner"
        as_owner = _kvdiag_as(other_user, "capture", "--pid", str(hanger.pid), "--out", str(out))
        assert as_owner.returncode == 10, as_owner.stdout + as_owner.stderr
        assert _outcome(out)[:2] == ("gil_cycle", 10)
    finally:
        os.killpg(hanger.pid, signal.SIGKILL)
        hanger.wait(timeout=10)


# ---------------------------------------------------------------- outcomes that are not health


def test_a_zombie_is_its_own_outcome_with_its_exit_status(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    try:
        _wait_for(lambda: _state(child.pid) == "Z", "the child to become a zombie")
        out = tmp_path / "zombie"
        proc = run_kvdiag("capture", "--pid", str(child.pid), "--out", str(out))
        assert proc.returncode == 5, proc.stdout + proc.stderr
        kind, code, report = _outcome(out)
        assert (kind, code) == ("zombie", 5)
        assert "zombie" in proc.stdout and "exit code 7" in proc.stdout
        _assert_no_health_or_deadlock(proc, report)
    finally:
        child.wait(timeout=10)


def test_a_process_that_exits_mid_capture_is_exited(tmp_path: Path) -> None:
    target = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)
    out = tmp_path / "exited"
    kv: subprocess.Popen[str] | None = None
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        kv = subprocess.Popen([sys.executable, "-m", "kvdiag", "capture", "--pid", str(target.pid), "--out",
                               str(out), "--timeout", "30"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)

        def traced() -> bool:   # a stack tool is attached: the capture is under way
            status = Path(f"/proc/{target.pid}/status").read_text()
            return any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in status.splitlines())

        _wait_for(traced, "a stack tool to attach to the target", timeout_s=120)
        target.kill()   # the target goes away while it is being captured
        target.wait(timeout=10)
        stdout, stderr = kv.communicate(timeout=120)
    finally:
        target.kill()
        target.wait(timeout=10)
        if kv is not None and kv.poll() is None:
            kv.kill()
            kv.wait(timeout=10)
    assert kv.returncode == 5, stdout + stderr
    kind, code, report = _outcome(out)
    assert (kind, code) == ("exited", 5)
    assert "exited before or during capture" in stdout
    _assert_no_health_or_deadlock(subprocess.CompletedProcess([], 5, stdout, stderr), report)


def test_a_process_without_python_is_not_python(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "1000"])
    try:
        _wait_for(lambda: Path(f"/proc/{sleeper.pid}/exe").resolve().name != Path(sys.executable).name
                  and "sleep" in Path(f"/proc/{sleeper.pid}/comm").read_text(), "sleep to exec")
        assert check_target(sleeper.pid).python is False
        out = tmp_path / "sleep"
        proc = run_kvdiag("capture", "--pid", str(sleeper.pid), "--out", str(out))
        assert proc.returncode == 5, proc.stdout + proc.stderr
        kind, code, report = _outcome(out)
        assert (kind, code) == ("not_python", 5)
        assert "runs no Python interpreter" in proc.stdout
        _assert_no_health_or_deadlock(proc, report)
        bundle = json.loads((out / "bundle" / "bundle.json").read_text())
        tools = {t["tool"]: t for t in bundle["processes"][0]["tools"]}
        assert tools["proc"]["ok"] and all("skipped" in (tools[n]["error"] or "") for n in ("py-spy", "gdb"))
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


def test_pid_2_is_a_kernel_thread_and_is_refused(tmp_path: Path) -> None:
    if not is_kernel_thread(2):
        pytest.skip("pid 2 is not a kernel thread here (a private pid namespace)")
    out = tmp_path / "kthread"
    proc = run_kvdiag("capture", "--pid", "2", "--out", str(out))
    assert proc.returncode == 5, proc.stdout + proc.stderr
    kind, code, report = _outcome(out)
    assert (kind, code) == ("kernel_thread", 5)
    assert "kernel thread: capture refused" in proc.stdout
    _assert_no_health_or_deadlock(proc, report)
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    assert [p["pid"] for p in bundle["processes"]] == [2]   # its children were not touched either


def test_a_capture_whose_tools_all_fail_is_no_evidence(tmp_path: Path) -> None:
    """`--tools gdb` where gdb cannot be found: not one thread read, so no verdict (exit 3), not healthy."""
    target = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        out = tmp_path / "no-tools"
        env = {**os.environ, "PATH": str(tmp_path / "empty-path")}   # the venv's bin has no gdb
        proc = subprocess.run([sys.executable, "-m", "kvdiag", "capture", "--pid", str(target.pid), "--tools", "gdb",
                               "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        kind, code, report = _outcome(out)
        assert (kind, code) == ("no_evidence", 3)
        assert "gdb not installed" in proc.stdout
        _assert_no_health_or_deadlock(proc, report)
    finally:
        target.kill()
        target.wait(timeout=10)


def test_a_launched_engine_without_python_is_not_python(tmp_path: Path) -> None:
    """The same rule for engines kvdiag launches: a captured engine that runs no Python is not healthy."""
    scenario = {
        "name": "not-python", "windows": {"stall_s": 5, "startup_timeout_s": 60, "timeout_s": 120, "kill_grace_s": 1},
        "capture": {"tools": ["proc", "py-spy", "pystack", "gdb"], "tool_timeout_s": 10, "when": "always"},
        "engines": [{"name": "shell", "kind": "command", "allocator": "external", "ready": "log:ready",
                     "command": ["sh", "-c", "echo ready; exec sleep 1000"]}],
    }
    path = tmp_path / "not-python.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    out = tmp_path / "repro"
    proc = run_kvdiag("repro", "two-engine", "--scenario", str(path), "--out", str(out))
    assert proc.returncode == 5, proc.stdout[-3000:] + proc.stderr[-3000:]
    kind, code, report = _outcome(out)
    assert (kind, code) == ("not_python", 5)
    _assert_no_health_or_deadlock(proc, report)
