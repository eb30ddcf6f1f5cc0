"""Capture through kvdiag's in-process agent: stacks and GIL state with no ptrace and no memory read.

A process started with ``KVDIAG_AGENT=1`` (:mod:`kvdiag.agent`) carries a signal handler that, asked,
writes every thread's Python stack, native return addresses and GIL state into its private directory.
This module finds an armed process, asks it for one dump and turns that into the same
:class:`~kvdiag.model.evidence.ThreadEvidence` the pystack backend produces (GIL flags, Python and native
frames), so the analyzers judge it unchanged. The orchestrator picks this path for a process where
ptrace is refused (:func:`choose_path`), or everywhere with ``--via agent``.

Safety: a signal is sent only to a process whose armed record names its current start time and whose
``SigCgt`` shows the trigger handler installed (a real-time signal's default action would end it); a
stopped process is not asked (it could not answer), nor a traced one (the signal would stop it for its
tracer); every wait is bounded, and on giving up the request
file is removed, so an answer arriving late is thrown away by the agent itself.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from kvdiag.agent.protocol import (
    DIR_ENV,
    ENABLE_ENV,
    ArmedRecord,
    agent_dir,
    armed_name,
    private_dir_problem,
    prune_stale,
    request_name,
    starttime_of,
)
from kvdiag.capture.base import BackendResult
from kvdiag.capture.symbols import Symbolizer
from kvdiag.model.evidence import Frame, TargetAccess, ThreadEvidence, ToolRun
from kvdiag.model.kinds import GilState
from kvdiag.osread.files import read_text
from kvdiag.osread.maps import Mapping, parse_line
from kvdiag.osread.process import read_environ
from kvdiag.osread.status import read_status
from kvdiag.redact.files import write_redacted
from kvdiag.redact.rules import Tally

AGENT = "agent"
VIA_CHOICES = ("auto", "ptrace", "agent")
_POLL_S = 0.002
# Native frames of the interpreter's evaluation loop: the Python frames of the thread go there.
_EVAL_FRAMES = ("_PyEval_EvalFrameDefault", "_PyEval_EvalFrame", "PyEval_EvalFrame", "_PyEval_Vector",
                "PyEval_EvalCode")
_TAKE_GIL = ("take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "_PyEval_ReInitThreads")


# ----------------------------------------------------------------------------- finding an armed process

@dataclass(frozen=True)
class Armed:
    record: ArmedRecord
    directory: Path


def _dir_for(pid: int, uid: int | None) -> Path:
    env = read_environ(pid) or {}
    explicit = env.get(DIR_ENV, "")
    return Path(explicit) if explicit else agent_dir(uid)


_PRUNE_EVERY_S = 30.0
_pruned_at: dict[Path, float] = {}


def _prune(directory: Path, force: bool = False) -> None:
    """Remove the records and requests that processes gone without cleaning up left in our agent directory
    (a target killed with SIGKILL): at most every ``_PRUNE_EVERY_S`` per directory unless ``force``."""
    now = time.monotonic()
    last = _pruned_at.get(directory)
    if not force and last is not None and now - last < _PRUNE_EVERY_S:
        return
    _pruned_at[directory] = now
    prune_stale(directory)


def armed(pid: int) -> tuple[Armed | None, str]:
    """The agent armed in ``pid``, else None and why not (one line)."""
    status = read_status(pid)
    if status is None:
        _prune(agent_dir(), force=True)
        return None, f"pid {pid} is gone"
    directory = _dir_for(pid, status.uid)
    problem = private_dir_problem(directory)
    if problem is not None:
        env = read_environ(pid)
        started = env is not None and env.get(ENABLE_ENV) == "1"
        return None, (f"the agent directory is not usable ({problem})" if started
                      else f"pid {pid} was not started with {ENABLE_ENV}=1")
    _prune(directory)
    text = read_text(directory / armed_name(pid))
    record = ArmedRecord.parse(text) if text else None
    if record is None or record.pid != pid:
        env = read_environ(pid)
        if env is not None and env.get(ENABLE_ENV) == "1":
            return None, (f"pid {pid} has {ENABLE_ENV}=1 but no agent armed (kvdiag not importable by its Python, "
                          "or arming failed: its stderr says why)")
        return None, f"pid {pid} was not started with {ENABLE_ENV}=1"
    stat = read_text(f"/proc/{pid}/stat")
    if stat is None or starttime_of(stat) != record.starttime:
        _prune(directory, force=True)
        return None, f"the agent record for pid {pid} belongs to an earlier process with that pid"
    if status.sig_caught is None or not status.sig_caught >> (record.trigger - 1) & 1:
        return None, f"pid {pid} has no handler for the agent's signal {record.trigger} (it exec'd, or exited)"
    return Armed(record, directory), ""


def without_agent_signals(pid: int, caught: list[int] | None) -> list[int] | None:
    """``caught`` (the process's SigCgt) without the agent's own two signals: they wake nothing of the
    program, and a rule that asks whether a handler could end a wait must not count them."""
    if not caught or max(caught) < 32:
        return caught
    arm, _ = armed(pid)
    if arm is None:
        return caught
    return [n for n in caught if n not in (arm.record.trigger, arm.record.thread)]


@lru_cache(maxsize=1)
def ptrace_refused_here() -> bool:
    """True when ptrace(2) itself is refused to this process (a seccomp filter, as in a container without
    SYS_PTRACE): the stack tools, kvdiag's children, inherit the filter. Probed with a request on our own
    pid that needs no tracee (ESRCH when the call is allowed), so nothing is attached."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    ctypes.set_errno(0)
    rc = libc.ptrace(3, os.getpid(), None, None)   # PTRACE_PEEKUSER on a process we do not trace
    return rc == -1 and ctypes.get_errno() == errno.EPERM


def choose_path(via: str, access: TargetAccess | None, armed_ok: bool) -> tuple[str, str]:
    """("agent" | "ptrace", why) for one process. ``auto``: the agent where the target is armed and ptrace
    is refused (by the preflight, or to kvdiag itself by a seccomp filter); ptrace otherwise."""
    if via == "agent":
        return AGENT, "asked for (--via agent)"
    if via == "ptrace" or access is None or access.kernel_thread or access.zombie:
        return "ptrace", ""
    refused = []
    if not access.ptrace_ok or not access.tracers_ok:
        refused.append(access.refused[-1] if access.refused else "ptrace refused")
    elif ptrace_refused_here():
        refused.append("ptrace(2) is refused to kvdiag by a seccomp filter (as in a container without SYS_PTRACE)")
    if refused and armed_ok:
        return AGENT, f"ptrace refused: {refused[0]}"
    return "ptrace", ""


_REFUSED_WORDS = ("operation not permitted", "permission denied", "eperm", "eacces")


def attach_refused(errors: list[str | None]) -> bool:
    """Every one of these ptrace-tool errors says the kernel refused the attach (an LSM such as AppArmor or
    SELinux, seen only when a tool attaches)."""
    return bool(errors) and all(e is not None and any(w in e.lower() for w in _REFUSED_WORDS) for e in errors)


def askable(pid: int) -> Armed | None:
    """The armed agent of ``pid`` when it may be asked now (armed, neither stopped nor traced), else None."""
    arm, _ = armed(pid)
    return arm if arm is not None and _not_askable(pid) is None else None


# ----------------------------------------------------------------------------- asking for a dump

@dataclass
class DumpOutcome:
    text: str | None
    error: str | None
    duration_s: float


def _sigqueue(pid: int, sig: int, value: int) -> int:
    """0, or the errno of sigqueue(2)."""
    libc = ctypes.CDLL(None, use_errno=True)

    class _Sigval(ctypes.Union):
        _fields_ = [("sival_int", ctypes.c_int), ("sival_ptr", ctypes.c_void_p)]

    libc.sigqueue.argtypes = [ctypes.c_int, ctypes.c_int, _Sigval]
    val = _Sigval()
    val.sival_ptr = None
    val.sival_int = value
    return 0 if libc.sigqueue(pid, sig, val) == 0 else ctypes.get_errno()


def _stopped(pid: int) -> bool:
    status = read_status(pid)
    return status is not None and status.state in ("T", "t")


def _not_askable(pid: int) -> str | None:
    """Why ``pid`` must not be signalled now: stopped (it could not answer), or traced (every signal would
    stop it for its tracer, which may never let it go)."""
    status = read_status(pid)
    if status is None:
        return f"pid {pid} is gone"
    if status.tracer_pid:
        return f"pid {pid} is traced by pid {status.tracer_pid}: a signal would stop it for that tracer (not asked)"
    if status.state in ("T", "t"):
        return f"pid {pid} is stopped: its agent cannot answer until it is continued (not asked)"
    return None


def request_dump(pid: int, arm: Armed, timeout_s: float) -> DumpOutcome:
    """Ask the agent in ``pid`` for one dump and wait for it, at most ``timeout_s``."""
    start = time.monotonic()
    why = _not_askable(pid)
    if why is not None:
        return DumpOutcome(None, why, 0.0)
    nonce = secrets.randbelow((1 << 31) - 2) + 1
    req = arm.directory / request_name(pid, nonce, "req")
    done = arm.directory / request_name(pid, nonce, "dump")
    try:
        os.close(os.open(req, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except OSError as exc:
        return DumpOutcome(None, f"cannot write the request in {arm.directory}: {exc.strerror}", 0.0)
    try:
        status = read_status(pid)
        if status is None or status.sig_caught is None or not status.sig_caught >> (arm.record.trigger - 1) & 1:
            # the handler is gone (the process exec'd or is exiting): the signal's default action would end it
            return DumpOutcome(None, f"pid {pid} no longer handles the agent's signal (not asked)",
                               time.monotonic() - start)
        err = _sigqueue(pid, arm.record.trigger, nonce)
        if err:
            return DumpOutcome(None, f"sigqueue to pid {pid} failed: {os.strerror(err)}", time.monotonic() - start)
        deadline = start + timeout_s
        while time.monotonic() < deadline:
            try:
                text = done.read_text(encoding="utf-8", errors="replace")
            except FileNotFoundError:
                if read_status(pid) is None:
                    return DumpOutcome(None, f"pid {pid} exited before its agent answered",
                                       time.monotonic() - start)
                if _stopped(pid):
                    return DumpOutcome(None, f"pid {pid} was stopped before its agent answered",
                                       time.monotonic() - start)
                time.sleep(_POLL_S)
                continue
            try:
                done.unlink()
            except OSError:
                pass
            return DumpOutcome(text, None, time.monotonic() - start)
        return DumpOutcome(None, f"the agent in pid {pid} did not answer within {timeout_s:.1f}s",
                           time.monotonic() - start)
    finally:
        try:
            req.unlink()   # a late answer finds no request and is discarded by the agent
        except OSError:
            pass


# ----------------------------------------------------------------------------- reading a dump

@dataclass
class AgentThread:
    tid: int
    answered: bool
    state: str = ""               # answered / blocked (blocks the signal) / asleep (not woken) / noanswer
    pthread: int | None = None
    holds_gil: int | None = None
    has_tstate: int | None = None
    pc: int | None = None
    addresses: list[int] = field(default_factory=list)


@dataclass
class AgentDump:
    pid: int
    python: str | None
    threads: list[AgentThread]
    python_stacks: dict[int, list[Frame]]     # pthread id -> Python frames, innermost first
    maps: list[Mapping]
    complete: bool
    # pthread id -> (kernel tid, whether it is the runtime's current thread state): None where not written
    tstates: dict[int, tuple[int | None, bool | None]] = field(default_factory=dict)
    elapsed_ms: int | None = None
    collect_ms: int | None = None


_FH_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')


def _python_stacks(lines: list[str]) -> dict[int, list[Frame]]:
    out: dict[int, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in lines:
        head = _FH_THREAD.match(line)
        if head:
            current = out.setdefault(int(head.group(1), 16), [])
            continue
        fm = _FH_FRAME.match(line)
        if fm and current is not None:
            lineno = int(fm.group(2)) if fm.group(2).isdigit() else None
            current.append(Frame(name=fm.group(3).strip(), kind="python", file=fm.group(1), line=lineno))
    return out


def parse_dump(text: str) -> AgentDump | None:
    """The agent's dump (csrc/agent.cpp writes it); None when it is not one."""
    lines = text.splitlines()
    if not lines or lines[0] != "kvdiag-agent 1":
        return None
    head: dict[str, str] = {}
    i = 1
    while i < len(lines) and lines[i] != "python-stacks":
        key, _, value = lines[i].partition(" ")
        head[key] = value
        i += 1
    try:
        end_py = lines.index("end-python-stacks", i)
    except ValueError:
        end_py = len(lines)
    stacks = _python_stacks(lines[i + 1:end_py])
    threads: list[AgentThread] = []
    maps: list[Mapping] = []
    j = end_py + 1
    while j < len(lines) and lines[j].startswith("thread "):
        parts = lines[j].split()
        th = AgentThread(tid=int(parts[1]), answered=parts[2] == "answered", state=parts[2])
        if th.answered:
            kv = parts[3:]
            at = kv.index("frames") if "frames" in kv else len(kv)
            fields = dict(zip(kv[:at:2], kv[1:at:2], strict=False))
            th.pthread = int(fields.get("pthread", "0"), 16)
            th.holds_gil = int(fields.get("gil", "-1"))
            th.has_tstate = int(fields.get("tstate", "-1"))
            th.pc = int(fields.get("pc", "0"), 16)
            th.addresses = [int(a, 16) for a in kv[at + 1:]]
        threads.append(th)
        j += 1
    tstates: dict[int, tuple[int | None, bool | None]] = {}
    while j < len(lines) and lines[j].startswith("tstate "):
        kv = lines[j].split()[1:]
        fields = dict(zip(kv[::2], kv[1::2], strict=False))
        try:
            native = int(fields["native"]) if "native" in fields else None
            current = fields["current"] == "1" if "current" in fields else None
            tstates[int(fields["pthread"], 16)] = (native, current)
        except (KeyError, ValueError):
            pass
        j += 1
    if j < len(lines) and lines[j] == "maps":
        j += 1
        while j < len(lines) and lines[j] != "end-maps":
            m = parse_line(lines[j])
            if m is not None:
                maps.append(m)
            j += 1
    tail = dict(ln.partition(" ")[::2] for ln in lines[j:] if " " in ln)
    elapsed = tail.get("elapsed_ms")
    collect = head.get("collect_ms")
    return AgentDump(pid=int(head.get("pid", "0")), python=head.get("python"), threads=threads,
                     python_stacks=stacks, maps=maps, complete=lines[-1] == "end", tstates=tstates,
                     elapsed_ms=int(elapsed) if elapsed and elapsed.lstrip("-").isdigit() else None,
                     collect_ms=int(collect) if collect and collect.lstrip("-").isdigit() else None)


def _native_frames(th: AgentThread, sym: Symbolizer) -> list[Frame]:
    """The thread's own frames, innermost first, without the signal handler's frames above them."""
    addrs = th.addresses
    if th.pc and th.pc in addrs:
        addrs = addrs[addrs.index(th.pc):]
        first_is_pc = True
    else:
        names = [sym.name(a).function or "" for a in addrs]
        cut = next((k + 1 for k, n in enumerate(names) if n == "__restore_rt"), 0)
        addrs = addrs[cut:]
        first_is_pc = cut > 0
    frames: list[Frame] = []
    for k, addr in enumerate(addrs):
        named = sym.name(addr, return_address=not (k == 0 and first_is_pc))
        frames.append(Frame(name=named.function or f"0x{addr:x}", kind="native", library=named.library))
    return frames


def _interleave(native: list[Frame], python: list[Frame]) -> list[Frame]:
    """One stack, innermost first: native frames down to the interpreter's evaluation loop, the Python
    frames there, then the native frames that called the interpreter."""
    if not python:
        return native
    at = next((k for k, f in enumerate(native) if f.name.startswith(_EVAL_FRAMES)), None)
    if at is None:
        return native + python
    outer = [f for f in native[at:] if not f.name.startswith(_EVAL_FRAMES)]
    return native[:at] + python + outer


def _gil(th: AgentThread, native: list[Frame]) -> GilState:
    if th.holds_gil == 1:
        return GilState.HOLDS
    if th.has_tstate == 0:
        return GilState.NONE       # no thread state: it can neither hold nor be taking the GIL
    if th.has_tstate == 1 and any(f.name in _TAKE_GIL for f in native[:12]):
        return GilState.WAITING
    return GilState.UNKNOWN        # has a thread state, not holding: /proc's futex reading decides


def dump_threads(dump: AgentDump, pid: int) -> list[ThreadEvidence]:
    """ThreadEvidence per thread of the dump (frames innermost first), as the pystack backend gives them."""
    sym = Symbolizer(pid, dump.maps)
    out: list[ThreadEvidence] = []
    claimed: set[int] = set()
    by_native = {native: (pthread, current) for pthread, (native, current) in dump.tstates.items()
                 if native is not None}
    for th in dump.threads:
        if not th.answered:
            # Not interrupted (asleep, or blocking the signal): its Python stack through the thread-state list,
            # and on 3.10/3.11 whether it is the GIL holder.
            pthread, current = by_native.get(th.tid, (None, None))
            python = dump.python_stacks.get(pthread, []) if pthread is not None else []
            gil = GilState.HOLDS if current else GilState.NONE if current is False and th.state == "asleep" \
                else GilState.UNKNOWN
            out.append(ThreadEvidence(tid=th.tid, gil=gil, frames=list(python)))
            continue
        native = _native_frames(th, sym)
        python = dump.python_stacks.get(th.pthread or -1, []) if th.pthread not in claimed else []
        if th.pthread is not None and python:
            claimed.add(th.pthread)
        out.append(ThreadEvidence(tid=th.tid, gil=_gil(th, native), frames=_interleave(native, python)))
    return out


# ----------------------------------------------------------------------------- the backend

class AgentBackend:
    """Reads one armed process through its agent. Listed with the ptrace tools (it interrupts every thread
    of the target for the dump, a few milliseconds), so it runs after the /proc window, never inside it."""

    name = AGENT
    stops_target = True

    def available(self) -> str | None:
        return None

    def capture(self, pid: int, timeout_s: float, raw_dir: Path) -> BackendResult:
        arm, why = armed(pid)
        if arm is None:
            return BackendResult(tool=ToolRun(tool=self.name, ok=False, error=f"agent: {why}"))
        outcome = request_dump(pid, arm, max(0.1, timeout_s))
        command = [f"sigqueue({pid}, {arm.record.trigger})", str(arm.directory)]
        if outcome.text is None:
            return BackendResult(tool=ToolRun(tool=self.name, ok=False, duration_s=round(outcome.duration_s, 3),
                                              error=f"agent: {outcome.error}", command=command))
        tally = Tally()
        raw: Path | None = raw_dir / "agent.txt"
        try:
            raw_dir.mkdir(parents=True, exist_ok=True)
            write_redacted(raw_dir / "agent.txt", outcome.text, tally)
        except OSError:
            raw = None
        dump = parse_dump(outcome.text)
        threads = dump_threads(dump, pid) if dump is not None else []
        ok = dump is not None and dump.complete and any(t.frames for t in threads)
        err = None if ok else "agent: incomplete dump" if dump is not None else "agent: unreadable dump"
        run = ToolRun(tool=self.name, ok=ok, duration_s=round(outcome.duration_s, 3), error=err,
                      raw_path=str(raw) if raw else None, command=command, redactions=tally.as_dict())
        return BackendResult(tool=run, threads=threads, python_version=dump.python if dump else None)


__all__ = ["AGENT", "VIA_CHOICES", "AgentBackend", "AgentDump", "armed", "askable", "attach_refused", "choose_path",
           "dump_threads",
           "parse_dump", "ptrace_refused_here", "request_dump", "without_agent_signals"]
