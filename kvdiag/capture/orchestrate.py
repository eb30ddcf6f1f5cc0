"""Run every capture backend against every process, in parallel, within one wall-clock bound.

Schedule (parallel capture):
1. one /proc progress window for every process at once (:meth:`ProcBackend.begin`, focus processes
   first; 0.4 s): the first sample, then inside the window what needs no second sample (identity, the
   GIL's place, the fds blocked threads wait on) and the tools that never pause a target
   (``py-spy --nonblocking``); nothing pauses a target while its window is open;
2. as each window closes, that process's ptrace tools one after the other (Linux allows one tracer
   at a time), verdict-critical first: pystack --native-all (the interpreter's own GIL flags, Python
   and native frames); gdb only where pystack read no native frame (missing, refused, failed, timed
   out), capped at GDB_BUDGET_S per process and loading the symbols of tools.GDB_LIBRARIES only;
   py-spy --native only where pystack cannot read native frames;
3. across processes, at most one ptrace tool per CPU at a time (:class:`_ToolSlots`), most urgent
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
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvdiag.bundle import raw_dir as bundle_raw_dir
from kvdiag.capture.access import check_target
from kvdiag.capture.base import BackendResult, CaptureBackend, kill_active_tools
from kvdiag.capture.merge import merge_threads
from kvdiag.capture.procfs import ProcBackend, ProcWindow
from kvdiag.capture.tools import (
    GdbBackend,
    PyspyBackend,
    PystackBackend,
    gdb_all_symbols,
    pyspy_nonblocking,
    pystack_lock_locals,
)
from kvdiag.capture.untouched import Before, observe, resume_if_left_stopped, verify_untouched
from kvdiag.defaults import DEFAULT_TOOLS
from kvdiag.model import Finding, ProcessEvidence, TargetAccess, ToolRun
from kvdiag.osread.nvml import GpuSampler, gpu_present

CAPTURE_SLACK_S = 3.0           # kill grace + verification on top of timeout_s
DEFAULT_BACKENDS = DEFAULT_TOOLS
_FACTORIES: dict[str, Callable[[], CaptureBackend]] = {
    "proc": ProcBackend, "py-spy": PyspyBackend, "pyspy": PyspyBackend,
    "py-spy-nonblocking": pyspy_nonblocking, "pystack": PystackBackend, "pystack-locals": pystack_lock_locals,
    "gdb": GdbBackend, "gdb-full": gdb_all_symbols}
# Order of the ptrace chain, whatever order the tools were named in: verdict-critical evidence first.
_CHAIN_ORDER = {"pystack": 0, "py-spy": 1, "gdb": 2, "gdb-full": 3}
# gdb is optional evidence: it gets at most this long per process (the chains run in parallel, so this
# bounds the whole capture's gdb time whatever the number of processes).
GDB_BUDGET_S = 4.0
# Every ptrace tool pauses its target while it reads: it runs at a higher CPU priority where kvdiag may raise
# it (root / CAP_SYS_NICE), so on a busy machine it ends sooner and the pause is shorter.
# The focus processes' pystack still goes first: the others wait for it (_ToolSlots).
_PTRACE_NICE = -5
# A ptrace tool that is not last in the chain gets at most this share of the budget, so a hung
# pystack still leaves gdb time to run.
_CHAIN_SHARE = 0.35
_MIN_TOOL_S = 2.0


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


def _skip_reason(access: TargetAccess, backend: CaptureBackend) -> tuple[str, bool] | None:
    """Why the preflight keeps ``backend`` away from a process, and whether that is kvdiag's choice
    (True: nothing to read there) rather than a refusal (None: run it)."""
    if backend.name == "proc":
        return None
    if access.kernel_thread:
        return f"{backend.name} skipped: a kernel thread (capture refused)", True
    if access.zombie:
        return f"{backend.name} skipped: the process is a zombie (exited, not reaped)", True
    if not access.ptrace_ok or not access.tracers_ok:
        return (f"{backend.name} skipped: access refused ({access.refused[-1] if access.refused else 'ptrace'})",
                False)
    if access.python is False:
        return f"{backend.name} skipped: no Python interpreter in the process", True
    return None


class _ProcessJob:
    """All backends for one pid: quiet backends at once, ptrace backends after /proc, in sequence."""

    def __init__(self, pid: int, backends: list[CaptureBackend], unavailable: dict[str, str],
                 raw_dir: Path, timeout_s: float, deadline: float, access: TargetAccess | None = None,
                 slots: _ToolSlots | None = None, rank: int = 0, t0: float | None = None) -> None:
        self.pid = pid
        self.backends = backends
        self.slots = slots              # shared by every process's chain: ptrace tools at once, most urgent first
        self.rank = rank                # 0: a focus process (its tools go first), 1: the others
        self._released_focus = False
        if slots is not None and rank == 0:
            slots.add_focus()
        self.t0 = t0 if t0 is not None else time.monotonic()   # the capture's start (ToolRun.started_s)
        self.access = access
        self.unavailable = dict(unavailable)
        self.skipped: set[str] = set()   # of ``unavailable``: left out on purpose, not failed
        if access is not None:   # the preflight's refusals: quick, and said in the report
            for b in backends:
                skip = _skip_reason(access, b)
                if skip is not None and b.name not in self.unavailable:
                    self.unavailable[b.name] = skip[0]
                    if skip[1]:
                        self.skipped.add(b.name)
        self.raw_dir = bundle_raw_dir(raw_dir, pid)   # the bundle's one raw layout
        self.timeout_s = timeout_s
        self.deadline = deadline
        self.results: dict[str, BackendResult] = {}
        self.started: dict[str, float] = {}
        self.before: Before | None = None      # the target as found (set by capture_processes)
        self.resumed: Finding | None = None     # a stop a tool left, undone before the next tool
        self._lock = threading.Lock()
        self._proc_done = threading.Event()
        self.threads: list[threading.Thread] = []

    def _remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _run_one(self, b: CaptureBackend, budget: float) -> None:
        began = time.monotonic()
        with self._lock:
            self.started[b.name] = began
        try:
            res = b.capture(self.pid, budget, self.raw_dir)
        except Exception as exc:  # a backend bug must not cost the other evidence
            res = BackendResult(tool=ToolRun(tool=b.name, ok=False, error=f"{type(exc).__name__}: {exc}"))
        self.set_result(b.name, res, began)

    def set_result(self, name: str, res: BackendResult, began: float) -> None:
        res.tool.started_s = round(began - self.t0, 3)
        with self._lock:
            self.started.setdefault(name, began)
            self.results[name] = res

    def _quiet(self, b: CaptureBackend) -> None:
        try:
            self._run_one(b, self._remaining())
        finally:
            if b.name == "proc":
                self._proc_done.set()

    def proc_backend(self) -> ProcBackend | None:
        """The /proc backend when it runs on this process (the shared progress window drives it)."""
        return next((b for b in self.backends if isinstance(b, ProcBackend) and b.name not in self.unavailable),
                    None)

    def open_window(self, pb: ProcBackend) -> ProcWindow | None:
        """First half of /proc (see :meth:`ProcBackend.begin`); None when it already ended."""
        began = time.monotonic()
        try:
            opened = pb.begin(self.pid, self._remaining())
        except Exception as exc:  # a backend bug must not cost the other evidence
            opened = BackendResult(tool=ToolRun(tool=pb.name, ok=False, error=f"{type(exc).__name__}: {exc}"))
        if isinstance(opened, BackendResult):
            self.set_result(pb.name, opened, began)
            self._proc_done.set()
            return None
        with self._lock:
            self.started.setdefault(pb.name, began)
        return opened

    def close_window(self, pb: ProcBackend, window: ProcWindow) -> None:
        try:
            res = pb.finish(window, self.raw_dir)
        except Exception as exc:  # a backend bug must not cost the other evidence
            res = BackendResult(tool=ToolRun(tool=pb.name, ok=False, error=f"{type(exc).__name__}: {exc}"))
        self.set_result(pb.name, res, window.start)
        self._proc_done.set()

    def _chain(self, chain: list[CaptureBackend]) -> None:
        try:
            self._chain_inner(chain)
        finally:
            self._focus_done()

    def _focus_done(self) -> None:
        """This focus process's verdict-critical tool has ended: the other processes' tools may start."""
        if self.rank == 0 and self.slots is not None and not self._released_focus:
            self._released_focus = True
            self.slots.focus_done()

    def _chain_inner(self, chain: list[CaptureBackend]) -> None:
        self._proc_done.wait(timeout=self._remaining())
        for i, b in enumerate(chain):
            if i == 1:
                self._focus_done()
            if self.slots is not None:
                if not self.slots.acquire((_CHAIN_ORDER.get(b.name, 9), self.rank), self._remaining()):
                    spent = f"{b.name} skipped: capture budget of {self.timeout_s:.1f}s spent"
                    with self._lock:
                        self.results[b.name] = BackendResult(tool=ToolRun(tool=b.name, ok=False, error=spent))
                    continue
                try:
                    self._chain_step(i, b, chain)
                finally:
                    self.slots.release()
            else:
                self._chain_step(i, b, chain)

    def _chain_step(self, i: int, b: CaptureBackend, chain: list[CaptureBackend]) -> None:
        covered = self._native_covered() if isinstance(b, GdbBackend) and not b.all_symbols else None
        if covered is not None:
            with self._lock:
                self.unavailable[b.name] = covered
                self.skipped.add(b.name)
            return
        budget = self._remaining()
        if i < len(chain) - 1:
            budget = min(budget, max(_MIN_TOOL_S, self.timeout_s * _CHAIN_SHARE))
        if b.name == "gdb":
            budget = min(budget, GDB_BUDGET_S)
        if budget <= 0.05:
            with self._lock:
                spent = f"{b.name} skipped: capture budget of {self.timeout_s:.1f}s spent"
                self.results[b.name] = BackendResult(tool=ToolRun(tool=b.name, ok=False, error=spent))
            return
        self._run_one(b, budget)
        if self.before is not None and self.resumed is None:
            # A tool killed mid-attach leaves the target stopped: resume it now, not after the chain.
            with self._lock:
                res = self.results.get(b.name)
            killed = res is None or not res.tool.ok
            self.resumed = resume_if_left_stopped(self.pid, self.before, settle_s=1.0,
                                                  watch_s=0.5 if killed else 0.0)

    def _native_covered(self) -> str | None:
        """Why gdb need not run here: pystack already read every thread's native frames (None: run gdb).

        One debugger per process when it succeeds: gdb would stop the target a second time to read the same
        native stacks (several seconds of the capture on a vLLM tree); it stays the fallback wherever pystack
        is missing, refused, failed, timed out or read no native frame."""
        with self._lock:
            res = self.results.get("pystack")
        tool = next((b for b in self.backends if isinstance(b, PystackBackend)), None)
        if res is None or tool is None or not tool.native or not res.tool.ok or not res.threads:
            return None
        if not any(f.kind == "native" for t in res.threads for f in t.frames):
            return None
        return (f"gdb skipped: pystack read the native frames of all {len(res.threads)} threads "
                "(gdb runs where pystack cannot)")

    def usable_backends(self) -> tuple[list[CaptureBackend], list[CaptureBackend]]:
        ready = [b for b in self.backends if b.name not in self.unavailable]
        quiet = [b for b in ready if not b.stops_target]
        chain = sorted((b for b in ready if b.stops_target), key=lambda b: _CHAIN_ORDER.get(b.name, 9))
        if not any(b.name == "proc" for b in quiet):
            self._proc_done.set()
        return quiet, chain

    def start_quiet(self, skip: CaptureBackend | None = None) -> None:
        """Start the backends that never pause the target (``skip``: run by the caller)."""
        quiet, _ = self.usable_backends()
        for b in quiet:
            if b is not skip:
                self._spawn(self._quiet, b, f"kvdiag-capture-{b.name}-{self.pid}")

    def start_chain(self) -> None:
        """Start the ptrace chain (it waits for /proc and for the focus processes' first tool)."""
        _, chain = self.usable_backends()
        if chain:
            self._spawn(self._chain, chain, f"kvdiag-capture-chain-{self.pid}")
        else:
            self._focus_done()   # nothing to attach here: the other processes need not wait for it

    def _spawn(self, target: Callable[..., None], arg: object, name: str) -> None:
        t = threading.Thread(target=target, args=(arg,), daemon=True, name=name)
        self.threads.append(t)
        t.start()

    def start(self) -> None:
        self.start_quiet()
        self.start_chain()

    def run_serially(self) -> None:
        quiet, chain = self.usable_backends()
        for b in quiet:
            self._quiet(b)
        self._chain(chain)

    def join(self, until: float) -> None:
        for t in self.threads:
            t.join(timeout=max(0.0, until - time.monotonic()))

    def snapshot_results(self) -> dict[str, BackendResult]:
        with self._lock:
            out = dict(self.results)
            started = dict(self.started)
        now = time.monotonic()
        for b in self.backends:
            if b.name in out or b.name in self.unavailable:
                continue
            ran = now - started[b.name] if b.name in started else 0.0
            out[b.name] = BackendResult(tool=ToolRun(
                tool=b.name, ok=False, duration_s=round(ran, 3),
                error=f"{b.name} timed out after {self.timeout_s:.1f}s (abandoned)"))
        return out


def _relative(path: str | None, bundle_dir: Path | None) -> str | None:
    if path is None or bundle_dir is None:
        return path
    try:
        return os.path.relpath(path, bundle_dir)
    except ValueError:
        return path


class _ToolSlots:
    """At most ``n`` ptrace tools run at once, across all processes (one per CPU: more only makes each
    slower); a free slot goes to the most urgent waiting tool: (tool order, focus first), then first come.

    The processes outside the focus wait until every focus process's first ptrace tool (pystack: the
    verdict-critical one) has ended: it gets the machine to itself (on 2 cores that brought the EngineCore's
    verdict in 0.15 s sooner and cost the whole capture 0.4 s)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.busy = 0
        self.focus_left = 0     # focus processes whose first ptrace tool has not ended yet
        self._cond = threading.Condition()
        self._waiting: list[tuple[tuple[int, int], int]] = []
        self._seq = itertools.count()

    def add_focus(self) -> None:
        with self._cond:
            self.focus_left += 1

    def focus_done(self) -> None:
        with self._cond:
            self.focus_left = max(0, self.focus_left - 1)
            self._cond.notify_all()

    def _free(self, ticket: tuple[tuple[int, int], int]) -> bool:
        minor = ticket[0][1] > 0
        return (self.busy < self.n and self._waiting[0] == ticket) and not (minor and self.focus_left)

    def acquire(self, priority: tuple[int, int], timeout: float) -> bool:
        """Wait for a slot (bounded); False when ``timeout`` passed first. ``priority``: (tool order, rank)."""
        end = time.monotonic() + timeout
        with self._cond:
            ticket = (priority, next(self._seq))
            heapq.heappush(self._waiting, ticket)
            while not self._free(ticket):
                left = end - time.monotonic()
                if left <= 0:
                    self._waiting.remove(ticket)
                    heapq.heapify(self._waiting)
                    self._cond.notify_all()
                    return False
                self._cond.wait(left)
            heapq.heappop(self._waiting)
            self.busy += 1
            self._cond.notify_all()
            return True

    def release(self) -> None:
        with self._cond:
            self.busy -= 1
            self._cond.notify_all()


def _minor(backends: list[CaptureBackend]) -> list[CaptureBackend]:
    """The backends for a process outside the focus: the same tools (its chain waits behind the focus
    processes' pystack for a tool slot), with py-spy reading Python frames without pausing the target,
    inside the /proc window (pystack, or gdb where pystack cannot, reads the native frames)."""
    return [pyspy_nonblocking(b.binary) if isinstance(b, PyspyBackend) and b.native else b for b in backends]


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
                         and (access is None or _skip_reason(access, b) is None) for b in backends)
    if not native_pystack:
        return backends
    return [pyspy_nonblocking(b.binary) if isinstance(b, PyspyBackend) and b.native else b for b in backends]


def _shared_window(jobs: list[_ProcessJob]) -> None:
    """One /proc progress window for every process at once (focus processes first), with the tools that
    never pause a target (py-spy --nonblocking) running inside it; each process's ptrace chain starts the
    moment its own window closes (the focus processes' first). Nothing pauses a target while its window is
    open, and the windows overlap instead of following one another."""
    opened: list[tuple[_ProcessJob, ProcBackend, ProcWindow]] = []
    try:
        for job in jobs:
            pb = job.proc_backend()
            window = job.open_window(pb) if pb is not None else None
            if pb is not None and window is not None:
                opened.append((job, pb, window))
            job.start_quiet(skip=pb)
        closing = {id(job) for job, _, _ in opened}
        for job in jobs:   # no /proc here: the chain may start at once
            if id(job) not in closing:
                job.start_chain()
        for job, pb, window in opened:
            time.sleep(max(0.0, window.window_end - time.monotonic()))
            job.close_window(pb, window)
            job.start_chain()
    finally:   # interrupted inside the window: no /proc/PID/mem left open
        for _, _, window in opened:
            window.mem.close()


def capture_processes(pids: Sequence[int], raw_dir: Path, timeout_s: float = 10.0,
                      backends: Sequence[str | CaptureBackend] | None = None, *,
                      bundle_dir: Path | None = None, parallel: bool = True,
                      focus: Sequence[int] | None = None,
                      ) -> tuple[list[ProcessEvidence], list[Finding]]:
    """Capture evidence from ``pids`` read-only; never raises for tool problems.

    ``backends``: names ("proc", "py-spy", "pystack", "gdb") or backend objects; default all.
    Raw tool outputs go to ``raw_dir/<pid>/`` (:func:`kvdiag.bundle.raw_dir`, the one layout);
    ToolRun.raw_path is relative to ``bundle_dir``
    when given (absolute otherwise). ``parallel=False`` runs everything one after the other
    (the benchmark's baseline). Returns within ``timeout_s + CAPTURE_SLACK_S`` seconds.

    ``focus``: the processes most likely to hold the hang (a vLLM engine's EngineCore). Their
    verdict-critical evidence (/proc, then pystack with native frames) is taken first, with the
    machine to themselves; the other processes get /proc and a non-pausing py-spy at once, then (once
    the focus processes' pystack is done) pystack with Python frames and GIL flags only, and gdb.
    None: every process is a focus process.
    """
    chosen = make_backends(backends)
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
    jobs: list[_ProcessJob] = []
    slots = _ToolSlots(max(1, os.cpu_count() or 1)) if parallel else None
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
            job = _ProcessJob(pid, mine, unavailable, raw_dir, timeout_s,
                              deadline if parallel else time.monotonic() + timeout_s, accesses.get(pid),
                              slots=slots, rank=int(minor), t0=start)
            job.before = befores[pid]
            jobs.append(job)
            if not parallel:
                job.run_serially()
        if parallel:
            _shared_window(jobs)
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
        results = job.snapshot_results()
        proc_res = results.get("proc")
        ev = (proc_res.process.model_copy(deep=True) if proc_res and proc_res.process
              else ProcessEvidence(pid=job.pid))
        ev.threads = merge_threads(results)
        ev.access = job.access
        for b in chosen:
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
