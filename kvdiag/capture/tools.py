"""Backends that run an external stack tool: pystack, py-spy and gdb.

- pystack ptrace-attaches briefly (it is the only source of the interpreter's own
  "Has the GIL" flag); ``--native-all`` also covers native threads that never
  registered with the interpreter (a C++ worker thread).
- py-spy runs ``--native`` (Python and native frames interleaved, as the seed's
  author ran it). That pauses the target for the dump like pystack and gdb do,
  so it joins their one-tracer-at-a-time chain. ``py-spy-nonblocking`` never
  pauses the target, but py-spy cannot combine that with ``--native``; the
  orchestrator uses it wherever pystack reads the native frames.
- gdb runs in batch mode, reads all native stacks and detaches; auto-loading
  and debuginfod are off so it never reaches the network or runs target scripts.
  The orchestrator runs it where pystack read no native frame.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from kvdiag.capture.base import (
    BackendResult,
    ToolOutcome,
    failed_run,
    missing_reason,
    resolve_tool,
    run_tool,
    write_raw,
)
from kvdiag.capture.parsers import keep_lock_locals, keep_step_locals, parse_gdb, parse_pyspy, parse_pystack
from kvdiag.model.evidence import ThreadEvidence, ToolRun
from kvdiag.redact.rules import Tally


class _ToolBackend:
    """Shared plumbing: resolve the binary, run it bounded, save raw output, parse."""

    tool = ""         # the backend's name, its default binary and the stem of its raw output file
    stops_target = True   # each of these tools pauses its target while it reads (py-spy --nonblocking aside)
    nice = 0          # > 0: lower CPU priority (a process outside the capture's focus); < 0: higher (the focus)

    def __init__(self, binary: str | None = None) -> None:
        self.name = self.tool
        # An explicit path (or a name to look up) overrides the default tool name.
        self.binary = binary if binary is not None else self.tool
        self.raw_name = f"{self.tool}.txt"

    def _exe(self) -> str | None:
        if os.sep in self.binary:
            return self.binary if os.access(self.binary, os.X_OK) else None
        return resolve_tool(self.binary)

    def available(self) -> str | None:
        return None if self._exe() else missing_reason(self.binary)

    def argv(self, exe: str, pid: int) -> list[str]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[list[ThreadEvidence], str | None]:
        raise NotImplementedError

    def filter_output(self, text: str) -> str:
        """What of the tool's stdout may be kept (written raw and parsed); default: all of it."""
        return text

    def usable(self, outcome: ToolOutcome, threads: list[ThreadEvidence]) -> bool:
        return not outcome.timed_out and outcome.returncode == 0 and bool(threads)

    def capture(self, pid: int, timeout_s: float, raw_dir: Path) -> BackendResult:
        exe = self._exe()
        if exe is None:
            return BackendResult(tool=ToolRun(tool=self.name, ok=False, error=missing_reason(self.binary)))
        argv = self.argv(exe, pid)
        outcome = run_tool(argv, timeout_s, nice=self.nice)
        outcome = dataclasses.replace(outcome, stdout=self.filter_output(outcome.stdout))
        tally = Tally()
        raw = write_raw(raw_dir, self.raw_name, argv, outcome, tally)
        threads, version = self.parse(outcome.stdout) if not outcome.error else ([], None)
        if not self.usable(outcome, threads):
            run = failed_run(self.name, argv, outcome, timeout_s, raw)
            if run.error and not outcome.timed_out and threads:
                run.error += f" (partial output: {len(threads)} threads kept)"
            run.redactions = tally.as_dict()
            return BackendResult(tool=run, threads=threads, python_version=version)
        run = ToolRun(tool=self.name, ok=True, duration_s=round(outcome.duration_s, 3),
                      raw_path=str(raw) if raw else None, command=argv, redactions=tally.as_dict())
        return BackendResult(tool=run, threads=threads, python_version=version)


class PystackBackend(_ToolBackend):
    """``native=False`` reads Python frames and GIL flags only (no native unwinding through every
    library: several times cheaper on a torch-sized process)."""

    tool = "pystack"

    def __init__(self, binary: str | None = None, native: bool = True, lock_locals: bool = False) -> None:
        super().__init__(binary)
        self.native = native
        # --locals, keeping only lock-typed locals (name and address): who may hold a Python lock.
        self.lock_locals = lock_locals

    def argv(self, exe: str, pid: int) -> list[str]:
        return [exe, "remote", str(pid), *(["--native-all"] if self.native else []),
                *(["--locals"] if self.lock_locals else []), "--no-color"]

    def filter_output(self, text: str) -> str:
        return keep_lock_locals(text) if self.lock_locals else text

    def parse(self, text: str) -> tuple[list[ThreadEvidence], str | None]:
        return parse_pystack(text)


def pystack_lock_locals(binary: str | None = None) -> PystackBackend:
    """pystack with ``--locals``, of which only lock-typed locals are kept (``pystack-locals``)."""
    return PystackBackend(binary, lock_locals=True)


class PyspyBackend(_ToolBackend):
    tool = "py-spy"

    def __init__(self, binary: str | None = None, native: bool = True, steps: bool = False) -> None:
        super().__init__(binary)
        self.native = native
        # --native needs the target paused (ptrace); --nonblocking never pauses it.
        self.stops_target = native
        # --locals, of which only integer step counters are kept: the step a distributed rank is at.
        self.steps = steps

    def argv(self, exe: str, pid: int) -> list[str]:
        return [exe, "dump", "--pid", str(pid), "--native" if self.native else "--nonblocking",
                *(["--locals"] if self.steps else [])]

    def filter_output(self, text: str) -> str:
        return keep_step_locals(text) if self.steps else text

    def parse(self, text: str) -> tuple[list[ThreadEvidence], str | None]:
        return parse_pyspy(text)


def pyspy_nonblocking(binary: str | None = None) -> PyspyBackend:
    """py-spy without pausing the target (Python frames only)."""
    return PyspyBackend(binary, native=False)



# Shared libraries whose symbols gdb loads by default (regexes for gdb's `sharedlibrary`): the
# interpreter, the C library (pthread/futex frames) and the allocators (kvdiag's, kvcached's). A vLLM
# process maps ~200 libraries (libtorch_cpu alone is ~0.5 GB of symbols); reading all of them took
# gdb 5-11 s per process, these few 0.4 s. Frames in other libraries keep their address and library.
GDB_LIBRARIES = ("libpython", "libc[.]so", "libpthread", "libstdc", "_native", "kvcached", "vmm_ops")


class GdbBackend(_ToolBackend):
    """gdb in batch mode. ``all_symbols=False`` (the default, "gdb") loads symbols of GDB_LIBRARIES only;
    "gdb-full" reads every library's symbols (slow on torch-sized processes)."""

    tool = "gdb"

    def __init__(self, binary: str | None = None, all_symbols: bool = False) -> None:
        super().__init__(binary)
        self.all_symbols = all_symbols

    def argv(self, exe: str, pid: int) -> list[str]:
        argv = [exe, "-p", str(pid), "-batch", "-nx",
                "-iex", "set auto-load off", "-iex", "set debuginfod enabled off"]
        if not self.all_symbols:
            argv += ["-iex", "set auto-solib-add off"]
        argv += ["-ex", "set pagination off", "-ex", "set confirm off"]
        if not self.all_symbols:
            for lib in GDB_LIBRARIES:
                argv += ["-ex", f"sharedlibrary {lib}"]
        return argv + ["-ex", "thread apply all bt"]

    def parse(self, text: str) -> tuple[list[ThreadEvidence], str | None]:
        return parse_gdb(text), None

    def usable(self, outcome: ToolOutcome, threads: list[ThreadEvidence]) -> bool:
        # gdb exits 0 even when attach fails ("ptrace: Operation not permitted"); threads decide.
        return not outcome.timed_out and bool(threads) and any(t.frames for t in threads)


def gdb_all_symbols(binary: str | None = None) -> GdbBackend:
    """gdb reading every shared library's symbols (all native frames named; seconds per large process)."""
    b = GdbBackend(binary, all_symbols=True)
    b.name = "gdb-full"
    return b
