"""Run a sweep's cells: each run is `kvdiag repro` in its own process (the one lifecycle every command
uses: launch → watch → capture → analyze → report → teardown), its output folder inside the sweep's.

Runs go in parallel up to ``jobs`` where they share no modelled device and no fixed port. A finished
run leaves ``cells/<key>/run-<i>.json``, a finished cell ``cells/<key>/cell.json`` (both written
atomically), so an interrupted sweep keeps them and the next one starts where it stopped.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

import yaml
from pydantic import ValidationError

from kvdiag.bundle.io import atomic_write_text
from kvdiag.errors import ExitCode
from kvdiag.model.report import Report
from kvdiag.model.scalar import show_scalar
from kvdiag.model.sweep import Scalar, SweepCell, SweepRun
from kvdiag.pymodule import module_argv
from kvdiag.redact.rules import redact_text
from kvdiag.runs.sweep.plan import Params, SweepPlan
from kvdiag.runs.sweep.summarize import run_from_report, summarize_cell
from kvdiag.scenario.models import Scenario

CELLS_DIR = "cells"
STOP_WAIT_S = 30.0        # an interrupted run's own teardown (engines stopped, partial report)
RUN_SLACK_S = 120.0       # beyond the scenario's own timeout, before a run is taken as stuck
_PR_SET_PDEATHSIG = 1
INCONCLUSIVE_RETRIES = 1  # a run that names no deadlock and is not healthy runs once more


@dataclass
class CellSpec:
    """A planned cell: its values, the scenario it runs, and the features the rule may use."""

    key: str
    params: Params
    scenario: Scenario
    features: dict[str, Scalar]
    notes: list[str] = field(default_factory=list)

    def resources(self) -> set[str]:
        """What two runs must not hold at once: a named modelled device, a fixed port."""
        out = {f"device:{self.scenario.device.name}"} if self.scenario.device.name else set()
        out |= {f"port:{e.host}:{e.port}" for e in self.scenario.engines if e.port}
        return out


@dataclass
class _Running:
    cell: CellSpec
    index: int
    proc: subprocess.Popen[bytes]
    started: float
    run_dir: Path
    console: IO[bytes]
    deadline: float


class SweepStore:
    """The sweep folder: one sub-folder per cell, one record per finished run and per finished cell."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.cells_dir = out_dir / CELLS_DIR

    def cell_dir(self, key: str) -> Path:
        return self.cells_dir / key

    def load_cell(self, key: str) -> SweepCell | None:
        return _load(self.cell_dir(key) / "cell.json", SweepCell)

    def load_run(self, key: str, index: int) -> SweepRun | None:
        return _load(self.cell_dir(key) / f"run-{index}.json", SweepRun)

    def save_run(self, key: str, run: SweepRun) -> None:
        atomic_write_text(self.cell_dir(key) / f"run-{run.index}.json", run.model_dump_json(indent=1))

    def save_cell(self, cell: SweepCell) -> None:
        atomic_write_text(self.cell_dir(cell.key) / "cell.json", cell.model_dump_json(indent=1))


def _load(path: Path, model: type[_M]) -> _M | None:
    try:
        return model.model_validate_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, ValidationError):
        return None   # a record from another version or damaged: the cell runs again


Progress = Callable[[str], None]
_M = TypeVar("_M", SweepCell, SweepRun)


class SweepExecutor:
    """Hands out the plan's cells, runs them, records them; returns when done or interrupted."""

    def __init__(self, plan: SweepPlan, make_cell: Callable[[Params], CellSpec], store: SweepStore, *,
                 repeat: int, jobs: int, progress: Progress, run_timeout_s: float,
                 confirm_stall_s: float | None = None) -> None:
        self.plan = plan
        self.make_cell = make_cell
        self.store = store
        self.repeat = repeat
        self.jobs = max(1, jobs)
        self.progress = progress
        self.run_timeout_s = run_timeout_s
        self.confirm_stall_s = confirm_stall_s
        self.cells: dict[str, SweepCell] = {}
        self.specs: dict[str, CellSpec] = {}
        self._queue: list[tuple[CellSpec, int]] = []
        self._running: list[_Running] = []
        self._t0 = time.monotonic()
        self.runs_done_here = 0
        self.resumed_cells = 0
        self._tries: dict[tuple[str, int], int] = {}

    # -- bookkeeping -------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Take new cells from the plan: finished ones from the store, the rest queued run by run."""
        while True:
            fresh = self.plan.take()
            if not fresh:
                return
            for params in fresh:
                spec = self.make_cell(params)
                self.specs[spec.key] = spec
                stored = self.store.load_cell(spec.key)
                if isinstance(stored, SweepCell) and len(stored.runs) >= self.repeat:
                    self.cells[spec.key] = stored
                    self.resumed_cells += 1
                    self.plan.record(params, _hung(stored))
                    continue
                cell = SweepCell(key=spec.key, params=spec.params, features=spec.features, notes=spec.notes,
                                 repeat=self.repeat)
                for i in range(self.repeat):
                    run = self.store.load_run(spec.key, i)
                    if isinstance(run, SweepRun):
                        cell.runs.append(run)
                    else:
                        self._queue.append((spec, i))
                self.cells[spec.key] = cell
                self._write_scenario(spec)
                if len(cell.runs) >= self.repeat:
                    self._cell_done(spec)

    def _write_scenario(self, spec: CellSpec) -> None:
        text = _scenario_text(spec.scenario)
        atomic_write_text(self.store.cell_dir(spec.key) / "scenario.yaml", redact_text(text))

    def _cell_done(self, spec: CellSpec) -> None:
        cell = summarize_cell(self.cells[spec.key])
        self.cells[spec.key] = cell
        self.store.save_cell(cell)
        self.plan.record(spec.params, _hung(cell))

    # -- processes ---------------------------------------------------------------------------------
    def _busy(self) -> set[str]:
        return {r for run in self._running for r in run.cell.resources()}

    def _start(self, spec: CellSpec, index: int) -> None:
        run_dir = self.store.cell_dir(spec.key) / f"run-{index}"
        shutil.rmtree(run_dir, ignore_errors=True)   # what an interrupted attempt left
        run_dir.mkdir(parents=True)
        scenario, scen_name = spec.scenario, "scenario.yaml"
        if self._tries.get((spec.key, index)) and self.confirm_stall_s is not None:
            # The run again with the scenario's own stall window: a verdict that the short window gave
            # without naming a deadlock is confirmed, or turns out to be a slow start.
            scenario = spec.scenario.model_copy(deep=True)
            scenario.windows.stall_s = self.confirm_stall_s
            scen_name = "scenario-confirm.yaml"
        text = _scenario_text(scenario)
        # The redacted copy runs as it is unless redaction removed a value the engines need.
        scen_file = self.store.cell_dir(spec.key) / scen_name
        if scen_name != "scenario.yaml":
            atomic_write_text(scen_file, redact_text(text))
        by_stdin = redact_text(text) != text
        argv = [*module_argv("kvdiag"), "repro", "two-engine", "--scenario",
                "/dev/stdin" if by_stdin else str(scen_file), "--out", str(run_dir)]
        console = open(run_dir / "console.txt", "wb")  # noqa: SIM115 - closed when the run is reaped
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE if by_stdin else subprocess.DEVNULL,
                                    stdout=console, stderr=subprocess.STDOUT, start_new_session=True,
                                    close_fds=True, preexec_fn=_die_with_parent)
        except BaseException:
            console.close()
            raise
        if by_stdin and proc.stdin is not None:
            try:
                proc.stdin.write(text.encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass
        now = time.monotonic()
        self._running.append(_Running(spec, index, proc, now, run_dir, console, now + self.run_timeout_s))

    def _reap(self, r: _Running, rc: int, error: str | None = None) -> None:
        r.console.close()
        _redact_file(r.run_dir / "console.txt")
        wall = time.monotonic() - r.started
        report: Report | None = None
        try:
            report = Report.model_validate_json((r.run_dir / "report.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, ValidationError):
            report = None
        if error is None and report is None:
            error = f"the run exited {rc} without a report: {_tail(r.run_dir / 'console.txt')}"
        rel = str(r.run_dir.relative_to(self.store.out_dir))
        run = run_from_report(r.index, rc, report, rel, wall, error)
        tries = self._tries.get((r.cell.key, r.index), 0)
        if (run.outcome == "inconclusive" or run.verdict == "unknown") and tries < INCONCLUSIVE_RETRIES:
            # Neither hung nor healthy, or "hung" with no rule naming it (an engine still starting when a
            # short window ran out, on a busy host): run it again with the scenario's own window.
            self._tries[(r.cell.key, r.index)] = tries + 1
            kept = r.run_dir.with_name(f"{r.run_dir.name}-inconclusive-{tries + 1}")   # its evidence stays
            shutil.rmtree(kept, ignore_errors=True)
            r.run_dir.rename(kept)
            self.progress(f"{r.cell.key} run {r.index + 1}: {run.verdict}, no deadlock named: running it again"
                          + (f" with a {self.confirm_stall_s:g}s stall window" if self.confirm_stall_s else ""))
            self._queue.insert(0, (r.cell, r.index))
            return
        self.store.save_run(r.cell.key, run)
        cell = self.cells[r.cell.key]
        cell.runs.append(run)
        self.runs_done_here += 1
        if len(cell.runs) >= self.repeat:
            self._cell_done(r.cell)
        self._say_run(r.cell, run)

    def _poll(self) -> None:
        for r in list(self._running):
            rc = r.proc.poll()
            if rc is None and time.monotonic() > r.deadline:
                _stop([r], STOP_WAIT_S)
                self._running.remove(r)
                self._reap(r, r.proc.returncode if r.proc.returncode is not None else -9,
                           f"the run did not finish within {self.run_timeout_s:g}s and was stopped")
                continue
            if rc is None:
                continue
            self._running.remove(r)
            if rc == ExitCode.INTERRUPTED:
                raise KeyboardInterrupt(f"a cell's run was interrupted ({r.run_dir})")
            self._reap(r, rc)

    def run(self) -> bool:
        """Run every cell; True when it was interrupted (finished cells and runs are kept)."""
        try:
            self._admit()
            last_status = 0.0
            while self._queue or self._running:
                busy = self._busy()
                for item in list(self._queue):
                    if len(self._running) >= self.jobs:
                        break
                    spec, index = item
                    if spec.resources() & busy:
                        continue
                    self._queue.remove(item)
                    self._start(spec, index)
                    busy |= spec.resources()
                self._poll()
                self._admit()
                now = time.monotonic()
                if now - last_status >= 5.0:
                    last_status = now
                    self.progress(self.status())
                time.sleep(0.1)
        except KeyboardInterrupt:
            self.progress("interrupted: stopping the runs in flight (finished cells are kept)")
            self._stop_all()
            return True
        return False

    def _stop_all(self) -> None:
        running, self._running = self._running, []
        while True:
            try:
                _stop(running, STOP_WAIT_S)
                break
            except KeyboardInterrupt:   # a second Ctrl-C: the stop is already bounded, keep at it
                continue
        for r in running:
            r.console.close()
            shutil.rmtree(r.run_dir, ignore_errors=True)   # half a run: it runs again on resume

    # -- progress ----------------------------------------------------------------------------------
    def status(self) -> str:
        done = [c for c in self.cells.values() if c.outcome != "pending"]
        hung = sum(1 for c in done if c.hangs)
        planned = max(self.plan.planned(), len(self.cells))
        left = max(0, planned - len(done))
        eta = ""
        if self.runs_done_here:
            per_run = (time.monotonic() - self._t0) / self.runs_done_here
            runs_left = len(self._queue) + len(self._running) + max(0, planned - len(self.cells)) * self.repeat
            eta = f", ETA {_duration(per_run * runs_left)}"
        return (f"sweep: {len(done)} cell(s) done, {left} left, {hung} hung so far"
                f" ({len(self._running)} running{eta})")

    def _say_run(self, spec: CellSpec, run: SweepRun) -> None:
        values = " ".join(f"{k}={show_scalar(v)}" for k, v in spec.params.items())
        rep = f" run {run.index + 1}/{self.repeat}" if self.repeat > 1 else ""
        kind = f" {run.verdict}" if run.outcome != run.verdict else ""
        self.progress(f"{values}{rep}: {run.outcome}{kind} ({run.wall_s:.1f}s) — {self.status()}")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the sweep dies (even by SIGKILL), so a run never outlives
    it; kvdiag takes SIGTERM like Ctrl-C (teardown, partial report). Linux only; elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _hung(cell: SweepCell) -> bool:
    """A bisection's side of a cell: hung in at least half of its runs."""
    return bool(cell.runs) and 2 * cell.hangs >= len(cell.runs)


def _stop(runs: list[_Running], wait_s: float) -> None:
    """SIGTERM each run (kvdiag tears its engines down and writes a partial report), SIGKILL after
    ``wait_s`` (the run's reaper then stops its engines)."""
    for r in runs:
        if r.proc.poll() is None:
            try:
                os.kill(r.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    for r in runs:
        try:
            r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait(timeout=10)


def _scenario_text(scenario: Scenario) -> str:
    return yaml.safe_dump(scenario.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def _redact_file(path: Path) -> None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    clean = redact_text(text)
    if clean != text:
        atomic_write_text(path, clean)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return "(no output)"
    return " | ".join(text[-lines:]) or "(no output)"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def write_json(path: Path, data: object) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
