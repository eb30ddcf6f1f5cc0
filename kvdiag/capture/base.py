"""The capture-backend protocol and the bounded subprocess runner every tool goes through.

A backend reads one process and returns what it saw as partial
:class:`~kvdiag.model.evidence.ThreadEvidence` records (only the fields that tool
knows), the :class:`~kvdiag.model.evidence.ToolRun` that describes the attempt, and
findings. The orchestrator (:mod:`kvdiag.capture.orchestrate`) merges the
per-tool threads. Backends never raise for a missing tool, a timeout or a
dead target: they report it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvdiag.model.evidence import ProcessEvidence, ThreadEvidence, ToolRun
from kvdiag.model.run import Finding
from kvdiag.redact.files import write_redacted
from kvdiag.redact.rules import Tally

# After SIGTERM a tool gets this long to detach cleanly (gdb detaches on SIGTERM) before SIGKILL.
KILL_GRACE_S = 0.5


@dataclass
class BackendResult:
    """What one backend learned about one process."""

    tool: ToolRun
    threads: list[ThreadEvidence] = field(default_factory=list)
    process: ProcessEvidence | None = None      # process-level facts (proc backend only)
    findings: list[Finding] = field(default_factory=list)
    python_version: str | None = None


@runtime_checkable
class CaptureBackend(Protocol):
    """One evidence source. ``stops_target`` backends ptrace-stop the process (serialised per pid)."""

    name: str
    stops_target: bool

    def available(self) -> str | None:
        """None when usable, else one line saying why not (e.g. "gdb not installed ...")."""
        ...

    def capture(self, pid: int, timeout_s: float, raw_dir: Path) -> BackendResult:
        """Read ``pid`` within ``timeout_s`` seconds; raw output goes under ``raw_dir``."""
        ...


def tool_search_dirs() -> list[Path]:
    """PATH first (so a user's or a test's tool wins), then the running interpreter's bin dir."""
    dirs = [Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    for extra in (Path(sys.executable).parent, Path(sys.prefix) / "bin"):
        if extra not in dirs:
            dirs.append(extra)
    return dirs


def resolve_tool(name: str) -> str | None:
    """Absolute path of executable ``name`` or None."""
    for d in tool_search_dirs():
        found = shutil.which(name, path=str(d))
        if found:
            return found
    return None


def missing_reason(name: str) -> str:
    if os.sep in name:
        return f"{os.path.basename(name)} not installed ({name} is missing or not executable)"
    return f"{name} not installed (not on PATH nor in {Path(sys.executable).parent})"


@dataclass
class ToolOutcome:
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool
    error: str | None = None      # could not start it at all


def _leader_exited(pid: int, timeout_s: float) -> bool | None:
    """Wait up to ``timeout_s`` for our child ``pid`` to exit, without reaping it: while its zombie is
    unreaped the number stays ours, so a signal to its group cannot reach a process that reused it.
    None: already reaped (by another thread), the number no longer ours."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return None
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the tool's process group, then SIGKILL whatever is left after a short grace."""
    if proc.returncode is not None:
        return   # reaped: its number may belong to someone else now
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 1.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        exited = _leader_exited(proc.pid, grace)
        if exited is None:
            return
        if exited:
            # The leader exited (not reaped yet); members of its group may linger (a shell script's children).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            return


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def _die_with_kvdiag() -> None:
    """In the tool's child before exec: SIGKILL it if the kvdiag thread that started it dies (even by
    SIGKILL), so a hung debugger never outlives us attached to the target."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


_ACTIVE: set[subprocess.Popen[bytes]] = set()
_ACTIVE_LOCK = threading.RLock()   # re-entrant: an interrupt may land while this thread holds it


def kill_active_tools() -> int:
    """Kill every tool still running (capture interrupted): none may outlive kvdiag attached to a target."""
    with _ACTIVE_LOCK:
        procs = list(_ACTIVE)
    for proc in procs:
        _kill_group(proc)
    return len(procs)


def _raise_priority(nice: int) -> None:
    """In the tool's child (its own session): a higher CPU priority where permitted, silently not otherwise.

    The tool pauses its target while it reads, so the sooner it ends the shorter the pause. With the
    scheduler's autogroups (a session is one group) a process's own nice only ranks it inside its session,
    so the session's group is raised too."""
    try:
        with open("/proc/self/autogroup", "w", encoding="ascii") as fh:
            fh.write(str(nice))
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        pass


def run_tool(argv: list[str], timeout_s: float, env: dict[str, str] | None = None, nice: int = 0) -> ToolOutcome:
    """Run ``argv`` in its own process group with a hard wall-clock bound.

    On timeout the whole group is terminated (TERM, then KILL) and the partial
    output is returned. Never raises for tool failures. ``nice`` > 0 runs the tool
    at a lower CPU priority (evidence that can wait yields to what the verdict needs); < 0 at a higher
    one where kvdiag may raise it (root / CAP_SYS_NICE; otherwise unchanged).
    """
    start = time.monotonic()

    def child_setup() -> None:
        _die_with_kvdiag()
        if nice > 0:
            os.nice(nice)
        elif nice < 0:
            _raise_priority(nice)

    # Started and registered under the lock: a tool that attaches before this thread gets to register it
    # would escape kill_active_tools (an interrupt arriving right then left its target traced and stopped).
    with _ACTIVE_LOCK:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, close_fds=True, env=env,
                                    preexec_fn=child_setup)
        except OSError as exc:
            return ToolOutcome(None, "", "", time.monotonic() - start, False, f"cannot start {argv[0]}: {exc}")
        _ACTIVE.add(proc)
    timed_out = False
    out_b = err_b = b""
    try:
        out_b, err_b = proc.communicate(timeout=max(0.05, timeout_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        try:
            # Bounded: a grandchild that escaped the group could hold the pipes open.
            out_b, err_b = proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
    finally:
        if proc.poll() is None:
            _kill_group(proc)
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        with _ACTIVE_LOCK:
            _ACTIVE.discard(proc)
    return ToolOutcome(proc.returncode, out_b.decode("utf-8", "replace"), err_b.decode("utf-8", "replace"),
                       time.monotonic() - start, timed_out)


def write_raw(raw_dir: Path, name: str, argv: list[str], outcome: ToolOutcome,
              tally: Tally | None = None) -> Path | None:
    """Save a tool's full output (stdout, then stderr) for the bundle, redacted; None if it cannot be written.

    py-spy prints the target's command line and pystack its source lines: secrets in them are
    removed before the file exists (counted into ``tally``).
    """
    path = raw_dir / name
    head = (f"# {' '.join(argv)}\n# rc={outcome.returncode} duration_s={outcome.duration_s:.3f}"
            f"{' TIMED OUT' if outcome.timed_out else ''}\n")
    body = outcome.stdout
    if outcome.stderr.strip():
        body += "\n# --- stderr ---\n" + outcome.stderr
    try:
        write_redacted(path, head + body, tally)
    except OSError:
        return None
    return path


def first_error_line(text: str) -> str:
    """The most telling line of a tool's error output, without decoration."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        low = ln.lower()
        if "error" in low or "fail" in low or "denied" in low or "not permitted" in low:
            return _clean(ln)
    return _clean(lines[-1]) if lines else ""


def _clean(line: str) -> str:
    # pystack decorates errors with emoji; keep the report to plain text.
    return "".join(ch for ch in line if ord(ch) < 0x2000).strip()[:300]


def failed_run(tool: str, argv: list[str], outcome: ToolOutcome, timeout_s: float,
               raw: Path | None) -> ToolRun:
    """ToolRun for a tool that did not produce usable output."""
    if outcome.error:
        err = outcome.error
    elif outcome.timed_out:
        err = f"{tool} timed out after {timeout_s:.1f}s (killed)"
    else:
        detail = first_error_line(outcome.stderr) or first_error_line(outcome.stdout)
        err = f"{tool} exited {outcome.returncode}" + (f": {detail}" if detail else "")
    return ToolRun(tool=tool, ok=False, duration_s=round(outcome.duration_s, 3), error=err,
                   raw_path=str(raw) if raw else None, command=argv)
