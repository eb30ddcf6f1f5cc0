"""Run every capture backend against every process, in parallel, within one wall-clock bound.

Schedule (parallel capture):
1. one /proc progress window for every process at once (:meth:`ProcBackend.begin`, focus processes
   first; 0.4 s): the first sample, then inside the window what needs no second sample (identity, the
   GIL's place, the fds blocked threads wait on) and the tools that never pause a target
   (``py-spy --nonblocking``); nothing pauses a target while its window is open;
2. once every window has closed, each process's ptrace tools one after the other (Linux allows one tracer
   at a time), verdict-critical first: pystack --native-all (the interpreter's own GIL flags, Python
   and native frames); gdb only where pystack read no native frame (missing, refused, failed, timed
   out), capped at job.GDB_BUDGET_S per process and loading the symbols of tools.GDB_LIBRARIES only;
   py-spy --native only where pystack cannot read native frames;
3. across processes, at most one ptrace tool per CPU at a time (:class:`~kvdiag.capture.slots.ToolSlots`), most urgent
   first; the focus processes' pystack (the EngineCore's) runs with the machine to itself, the other
   processes' tools wait for it; every ptrace tool runs at a higher CPU priority where permitted
   (:data:`_PTRACE_NICE`: it pauses its target while it reads).
Each tool runs in its own process group and is killed at the deadline; a backend thread that is still
stuck then is abandoned (daemon) and reported.

Read-only guarantee: the state, tracer and task list of every target are
read before and after; a target left traced or stopped is a bug we report.
Never left stopped: a ptrace tool killed mid-attach (its SIGSTOP not yet
consumed) leaves the target stopped once the kernel detaches it. After every
ptrace tool, after the whole capture and when a capture is interrupted, each
target whose process or threads are stopped now but were not when found is
resumed with SIGCONT and the report says so (``capture_left_stopped``); a
target that was already stopped when found is left as found.

Bound: :func:`capture_processes` returns within ``timeout_s + CAPTURE_SLACK_S``; as every process
has its own chain and the chains run at once, the time does not grow with the number of processes
(on a real vLLM tree: API server, EngineCore, Worker, resource tracker).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvdiag.capture.access import check_target
from kvdiag.capture.agent import AGENT, AgentBackend, armed, choose_path, without_agent_signals
from kvdiag.capture.base import CaptureBackend, kill_active_tools
from kvdiag.capture.job import ProcessJob, skip_reason
from kvdiag.capture.merge import merge_threads
from kvdiag.capture.procfs import ProcBackend, ProcWindow
from kvdiag.capture.ranks import is_rank
from kvdiag.capture.slots import ToolSlots
from kvdiag.capture.tools import (
    GdbBackend,
    PyspyBackend,
    PystackBackend,
    gdb_all_symbols,
    pyspy_nonblocking,
    pystack_lock_locals,
)
from kvdiag.capture.untouched import observe, resume_if_left_stopped, verify_untouched
from kvdiag.defaults import DEFAULT_TOOLS
from kvdiag.model.evidence import ProcessEvidence, TargetAccess, ToolRun
from kvdiag.model.run import Finding
from kvdiag.osread.nvml import GpuSampler, gpu_present

CAPTURE_SLACK_S = 3.0           # kill grace + verification on top of timeout_s
DEFAULT_BACKENDS = DEFAULT_TOOLS
_FACTORIES: dict[str, Callable[[], CaptureBackend]] = {
    "proc": ProcBackend, "py-spy": PyspyBackend, "pyspy": PyspyBackend,
    "py-spy-nonblocking": pyspy_nonblocking, "pystack": PystackBackend, "pystack-locals": pystack_lock_locals,
    "gdb": GdbBackend, "gdb-full": gdb_all_symbols, "agent": AgentBackend}
# Every ptrace tool pauses its target while it reads: it runs at a higher CPU priority where kvdiag may raise
# it (root / CAP_SYS_NICE), so on a busy machine it ends sooner and the pause is shorter.
# The focus processes' pystack still goes first: the others wait for it (ToolSlots).
_PTRACE_NICE = -5


def make_backends(spec: Sequence[str | CaptureBackend] | None = None) -> list[CaptureBackend]:
    """Backend objects from names ("proc", "py-spy", "pystack", "gdb") or ready instances."""
    out: list[CaptureBackend] = []
    for item in spec if spec is not None else DEFAULT_BACKENDS:
        if isinstance(item, str):
            factory = _FACTORIES.get(item.lower())
            if factory is None:
                raise ValueError(f"unknown capture backend {item!r} (known: {', '.join(DEFAULT_BACKENDS)})")
            out.append(factory())
        else:
            out.append(item)
    return out


def _relative(path: str | None, bundle_dir: Path | None) -> str | None:
    if path is None or bundle_dir is None:
        return path
    try:
        return os.path.relpath(path, bundle_dir)
    except ValueError:
        return path


def _minor(backends: list[CaptureBackend]) -> list[CaptureBackend]:
    """The backends for a process outside the focus: the same tools (its chain waits behind the focus
    processes' pystack for a tool slot), with py-spy reading Python frames without pausing the target,
    inside the /proc window (pystack, or gdb where pystack cannot, reads the native frames)."""
    return _pyspy_without_pausing(backends)


def _pyspy_without_pausing(backends: list[CaptureBackend]) -> list[CaptureBackend]:
    """``backends`` with py-spy --native replaced by py-spy --nonblocking (Python frames, no pause)."""
    return [pyspy_nonblocking(b.binary) if isinstance(b, PyspyBackend) and b.native else b for b in backends]


def _with_steps(backends: list[CaptureBackend]) -> list[CaptureBackend]:
    """``backends`` with py-spy --nonblocking (a copy) also reading the frames' integer step counters
    (``--locals``, every other local dropped): for a rank of a distributed job, the step it is at. It never
    pauses the target."""
    out: list[CaptureBackend] = []
    for b in backends:
        if isinstance(b, PyspyBackend) and not b.native:
            b = copy.copy(b)
            b.steps = True
        out.append(b)
    return out


def _raised(backends: list[CaptureBackend]) -> list[CaptureBackend]:
    """The ptrace tools (copies) at a higher CPU priority (:data:`_PTRACE_NICE`)."""
    out: list[CaptureBackend] = []
    for b in backends:
        if isinstance(b, (PystackBackend, PyspyBackend, GdbBackend)) and b.stops_target:
            b = copy.copy(b)
            b.nice = _PTRACE_NICE
        out.append(b)
    return out


def _window_pyspy(backends: list[CaptureBackend], unavailable: dict[str, str],
                  access: TargetAccess | None) -> list[CaptureBackend]:
    """The backends for a focus process. Where pystack reads its native frames, py-spy --native would only
    repeat them while pausing the target once more: py-spy then reads the Python frames without pausing,
    inside the /proc progress window, and the ptrace chain is pystack then gdb. Without pystack (not
    installed, refused, or not asked for) py-spy keeps --native in the chain."""
    native_pystack = any(isinstance(b, PystackBackend) and b.native and b.name not in unavailable
                         and (access is None or skip_reason(access, b) is None) for b in backends)
    if not native_pystack:
        return backends
    return _pyspy_without_pausing(backends)


def _shared_window(jobs: list[ProcessJob], on_open: Callable[[], None] | None = None) -> None:
    """One /proc progress window for every process at once (focus processes first), with the tools that
    never pause a target (py-spy --nonblocking) running inside it; the ptrace chains start once every window
    has closed (the focus processes' first). Nothing pauses any process of the capture while a window is
    open, and the windows overlap instead of following one another."""
    opened: list[tuple[ProcessJob, ProcBackend, ProcWindow]] = []
    try:
        for job in jobs:
            pb = job.proc_backend()
            window = job.open_window(pb) if pb is not None else None
            if pb is not None and window is not None:
                opened.append((job, pb, window))
            job.start_quiet(skip=pb)
        if on_open is not None:
            on_open()
        closing = {id(job) for job, _, _ in opened}
        for job in jobs:   # no /proc here: the chain may start at once
            if id(job) not in closing:
                job.start_chain()
        # Every window closes before any of these processes is paused: a peer stopped by a ptrace tool while
        # another process's window is still open would look, from that window, like a peer that never answers.
        for job, pb, window in opened:
            time.sleep(max(0.0, window.window_end - time.monotonic()))
            job.close_window(pb, window)
        for job, _, _ in opened:
            job.start_chain()
    finally:   # interrupted inside the window: no /proc/PID/mem left open
        for _, _, window in opened:
            window.mem.close()


def _agent_path(job: ProcessJob, via: str, access: TargetAccess | None) -> Finding | None:
    """Put ``job`` on the agent path when :func:`~kvdiag.capture.agent.choose_path` says so: the agent
    joins its chain and every other tool but /proc is left out (said in its ToolRun). The finding says
    which path was taken and why; None: the ptrace tools read it."""
    if choose_path(via, access, True)[0] != AGENT:
        return None     # ptrace reads it (or nothing would): the agent is not even looked for
    arm, why_not = armed(job.pid)
    path, why = choose_path(via, access, arm is not None)
    if path != AGENT:
        return None
    job.backends = [*job.backends, AgentBackend()]
    for b in job.backends:
        if b.name not in ("proc", AGENT):
            job.unavailable[b.name] = f"{b.name} skipped: read through kvdiag's in-process agent ({why})"
            job.skipped.add(b.name)
    job.unavailable.pop(AGENT, None)
    how = "read through kvdiag's in-process agent" if arm is not None else "agent asked for but not armed"
    return Finding(kind="capture_path", pid=job.pid,
                   message=f"pid {job.pid}: {how} ({why})" + (f": {why_not}" if arm is None else ""))


def capture_processes(pids: Sequence[int], raw_dir: Path, timeout_s: float = 10.0,
                      backends: Sequence[str | CaptureBackend] | None = None, *,
                      bundle_dir: Path | None = None, parallel: bool = True,
                      focus: Sequence[int] | None = None, on_open: Callable[[], None] | None = None,
                      ) -> tuple[list[ProcessEvidence], list[Finding]]:
    """Capture evidence from ``pids`` read-only; never raises for tool problems.

    ``backends``: names ("proc", "py-spy", "pystack", "gdb") or backend objects; default all.
    Raw tool outputs go to ``raw_dir/<pid>/`` (:func:`kvdiag.bundle.io.raw_dir`, the one layout);
    ToolRun.raw_path is relative to ``bundle_dir``
    when given (absolute otherwise). ``parallel=False`` runs everything one after the other
    (the benchmark's baseline). Returns within ``timeout_s + CAPTURE_SLACK_S`` seconds.

    ``focus``: the processes most likely to hold the hang (a vLLM engine's EngineCore). Their
    verdict-critical evidence (/proc, then pystack with native frames) is taken first, with the
    machine to themselves; the other processes get /proc and a non-pausing py-spy at once, then (once
    the focus processes' pystack is done) pystack with Python frames and GIL flags only, and gdb.
    None: every process is a focus process.

    ``on_open``: called once every window has opened (the first samples taken), before any closes: what the
    caller runs beside the capture starts there, not while the first samples are read.
    """
    chosen = make_backends(backends)
    # "agent" among the backends reads every process through its agent; otherwise the agent stands in
    # for the stack tools wherever ptrace is refused and the target is armed.
    via = "agent" if any(b.name == AGENT for b in chosen) else "auto"
    chosen = [b for b in chosen if b.name != AGENT]
    focus_set = set(focus) if focus else None
    if focus_set is not None and not focus_set & set(pids):
        focus_set = None
    findings: list[Finding] = []
    unavailable: dict[str, str] = {}
    for b in chosen:
        reason = b.available()
        if reason is not None:
            unavailable[b.name] = reason
            findings.append(Finding(kind="tool_missing", message=reason))
    start = time.monotonic()
    deadline = start + timeout_s
    # The GPUs are sampled over the same window as the stacks (a child process, killed at its bound).
    gpus = GpuSampler() if gpu_present() else None
    befores = {pid: observe(pid) for pid in pids}
    # Preflight before attaching: may we read it, is it a kernel thread, a zombie, Python at all?
    accesses = {pid: check_target(pid) for pid in dict.fromkeys(pids) if befores[pid].exists}
    jobs: list[ProcessJob] = []
    slots = ToolSlots(max(1, os.cpu_count() or 1)) if parallel else None
    caller_order = list(pids)
    if focus_set is not None:  # focus processes first, so their chains start before the others wait
        pids = [p for p in pids if p in focus_set] + [p for p in pids if p not in focus_set]
    try:
        for pid in dict.fromkeys(pids):
            if not befores[pid].exists:
                findings.append(Finding(kind="process_gone", pid=pid, message=f"process {pid} does not exist"))
                continue
            minor = focus_set is not None and pid not in focus_set
            mine = _raised(_minor(chosen) if minor else _window_pyspy(chosen, unavailable, accesses.get(pid)))
            if is_rank(pid):
                mine = _with_steps(mine)
            job = ProcessJob(pid, mine, unavailable, raw_dir, timeout_s,
                              deadline if parallel else time.monotonic() + timeout_s, accesses.get(pid),
                              slots=slots, rank=int(minor), t0=start)
            job.before = befores[pid]
            path_note = _agent_path(job, via, accesses.get(pid))
            if path_note is not None:
                findings.append(path_note)
            else:
                job.agent_fallback = via == "auto"
            jobs.append(job)
            if not parallel:
                job.run_serially()
        if parallel:
            _shared_window(jobs, on_open)
            for job in jobs:
                job.join(deadline + CAPTURE_SLACK_S - 1.0)
    except BaseException as exc:
        if gpus is not None:
            gpus.stop()
        # Ctrl-C / SIGTERM mid-capture: no debugger may stay attached to the target after we are gone,
        # and none may stay stopped by one we killed. The exception carries what was resumed.
        kill_active_tools()
        resumed = [f for pid, b in befores.items()
                   if (f := resume_if_left_stopped(pid, b, settle_s=1.0, watch_s=0.5)) is not None]
        seen = {f.pid for f in resumed}
        resumed += [job.resumed for job in jobs if job.resumed is not None and job.resumed.pid not in seen]
        if resumed:
            exc.capture_findings = resumed  # type: ignore[attr-defined]
        raise

    evidence: list[ProcessEvidence] = []
    for pid in dict.fromkeys(pids):
        if not befores[pid].exists:
            evidence.append(ProcessEvidence(pid=pid, alive=False))
    for job in jobs:
        if job.fell_back:
            findings.append(Finding(kind="capture_path", pid=job.pid, message=(
                f"pid {job.pid}: read through kvdiag's in-process agent (the kernel refused every ptrace tool's "
                "attach)")))
        results = job.snapshot_results()
        proc_res = results.get("proc")
        ev = (proc_res.process.model_copy(deep=True) if proc_res and proc_res.process
              else ProcessEvidence(pid=job.pid))
        ev.threads = merge_threads(results)
        ev.signals_caught = without_agent_signals(job.pid, ev.signals_caught)
        ev.access = job.access
        for b in job.backends:
            if b.name in job.unavailable:
                ev.tools.append(ToolRun(tool=b.name, ok=False, error=job.unavailable[b.name],
                                        skipped=b.name in job.skipped))
                continue
            res = results[b.name]
            run = res.tool.model_copy()
            run.raw_path = _relative(run.raw_path, bundle_dir)
            ev.tools.append(run)
            if not ev.python_version and res.python_version:
                ev.python_version = res.python_version
            findings.extend(f.model_copy(update={"pid": f.pid or job.pid}) for f in res.findings)
            if not run.ok and run.error:
                kind = "tool_timeout" if "timed out" in run.error else "tool_failed"
                findings.append(Finding(kind=kind, pid=job.pid, message=f"pid {job.pid}: {run.error}"))
        findings.extend(verify_untouched(job.pid, befores[job.pid], resumed=job.resumed))
        evidence.append(ev)
    if gpus is not None:
        readings = gpus.result(wait_s=max(1.0, deadline + CAPTURE_SLACK_S - time.monotonic()))
        for ev in evidence:
            if ev.alive:
                ev.gpu = readings
    order = {pid: i for i, pid in enumerate(caller_order)}
    evidence.sort(key=lambda e: order.get(e.pid, len(order)))
    return evidence, findings
