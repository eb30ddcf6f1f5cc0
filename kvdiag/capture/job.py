"""One process's capture: its quiet backends at once, its ptrace tools one after the other.

A :class:`ProcessJob` owns the backends of one pid: the ones that never pause the target run at once
(the /proc backend inside the progress window the orchestrator opens for every process), the ptrace
tools run as a chain after /proc, verdict-critical first, each within its share of the budget and a
CPU slot (:class:`~kvdiag.capture.slots.ToolSlots`); a target a killed tool left stopped is resumed
before the next tool. :mod:`kvdiag.capture.orchestrate` decides which backends each process gets and
when its window and chain start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvdiag.bundle.io import raw_dir as bundle_raw_dir
from kvdiag.capture.agent import AgentBackend, askable, attach_refused
from kvdiag.capture.base import BackendResult, CaptureBackend
from kvdiag.capture.procfs import ProcBackend, ProcWindow
from kvdiag.capture.slots import ToolSlots
from kvdiag.capture.tools import GdbBackend, PystackBackend
from kvdiag.capture.untouched import Before, resume_if_left_stopped
from kvdiag.model.evidence import TargetAccess, ToolRun
from kvdiag.model.run import Finding

# Order of the ptrace chain, whatever order the tools were named in: verdict-critical evidence first.
_CHAIN_ORDER = {"agent": 0, "pystack": 0, "py-spy": 1, "gdb": 2, "gdb-full": 3}
# gdb is optional evidence: it gets at most this long per process (the chains run in parallel, so this
# bounds the whole capture's gdb time whatever the number of processes).
GDB_BUDGET_S = 4.0
# A ptrace tool that is not last in the chain gets at most this share of the budget, so a hung
# pystack still leaves gdb time to run.
_CHAIN_SHARE = 0.35
_MIN_TOOL_S = 2.0


def skip_reason(access: TargetAccess, backend: CaptureBackend) -> tuple[str, bool] | None:
    """Why the preflight keeps ``backend`` away from a process, and whether that is kvdiag's choice
    (True: nothing to read there) rather than a refusal (None: run it)."""
    if backend.name == "proc":
        return None
    if access.kernel_thread:
        return f"{backend.name} skipped: a kernel thread (capture refused)", True
    if access.zombie:
        return f"{backend.name} skipped: the process is a zombie (exited, not reaped)", True
    if (not access.ptrace_ok or not access.tracers_ok) and backend.name != "agent":
        return (f"{backend.name} skipped: access refused ({access.refused[-1] if access.refused else 'ptrace'})",
                False)
    if access.python is False:
        return f"{backend.name} skipped: no Python interpreter in the process", True
    return None


class ProcessJob:
    """All backends for one pid: quiet backends at once, ptrace backends after /proc, in sequence."""

    def __init__(self, pid: int, backends: list[CaptureBackend], unavailable: dict[str, str],
                 raw_dir: Path, timeout_s: float, deadline: float, access: TargetAccess | None = None,
                 slots: ToolSlots | None = None, rank: int = 0, t0: float | None = None) -> None:
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
                skip = skip_reason(access, b)
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
        # The agent after the chain where the kernel refused every ptrace tool at attach time (set by the
        # orchestrator on the ptrace path); fell_back: it ran.
        self.agent_fallback = False
        self.fell_back = False
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
            self._agent_after_refusal()
        finally:
            self._focus_done()

    def _agent_after_refusal(self) -> None:
        """The preflight allowed ptrace but the kernel refused every tool's attach: read the process through its
        agent instead, when it is armed and may be asked."""
        if not self.agent_fallback:
            return
        with self._lock:
            ran = [r.tool for name, r in self.results.items() if name in ("pystack", "gdb", "gdb-full")]
        if not ran or any(t.ok for t in ran) or not attach_refused([t.error for t in ran]):
            return
        if askable(self.pid) is None:
            return
        agent = AgentBackend()
        self.backends = [*self.backends, agent]
        self._run_one(agent, max(0.5, self._remaining()))
        self.fell_back = True

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
