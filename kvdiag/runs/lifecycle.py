"""The run every command that launches engines shares: launch → watch → capture → analyze → report.

:class:`LaunchedRun` is its launch → teardown frame; :func:`run_lifecycle` calls a command's
:class:`RunStages` inside it and ends with :func:`kvdiag.runs.output.finish`. Every stage is reached only
through its package's public functions and the Bundle passed between them.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

from rich.console import Console

from kvdiag import __version__, interrupts
from kvdiag.allocator import device_file_paths
from kvdiag.environment import add_engine_packages, collect_environment
from kvdiag.environment.host import host_record
from kvdiag.environment.interpreter import interpreter_of_pid
from kvdiag.errors import ExitCode, Interrupted
from kvdiag.launch.interpreters import engine_interpreters
from kvdiag.launch.owned import remove_unheld
from kvdiag.launch.process import ProcessSet, private_temp_path
from kvdiag.launch.reaper import run_device_name
from kvdiag.model.bundle import Bundle
from kvdiag.redact.bundle import note_file
from kvdiag.redact.files import copy_redacted, write_redacted
from kvdiag.redact.rules import Tally
from kvdiag.runs.engines import ScenarioRun
from kvdiag.runs.output import RunArtifacts, finish
from kvdiag.scenario.models import Scenario


def new_bundle(command: str) -> Bundle:
    return Bundle(kvdiag_version=__version__, command=command, host=host_record(),
                  created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  environment=collect_environment())


def _copy_logs_redacted(raw_log_dir: Path, bundle_dir: Path, bundle: Bundle | None = None) -> None:
    """Copy the engines' raw logs into bundle/logs/, redacted; what was removed goes into the summary."""
    logs_dir = bundle_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    for src in sorted(raw_log_dir.glob("*.log")):
        tally = Tally()
        copy_redacted(src, logs_dir / src.name, tally)
        if bundle is not None:
            note_file(bundle.redaction, f"logs/{src.name}", tally.as_dict())


class LaunchedRun:
    """The launch → teardown frame of every run that starts engines (repro, each side of ab, soak).

    On entry: the scenario's redacted copy in the bundle, a process set (own process groups,
    out-of-process reaper), a private folder for the engines' raw logs and the run's modelled
    device; ``self.run`` is the :class:`ScenarioRun` that launches and watches the engines.
    :meth:`copy_logs` puts redacted copies of the logs into the bundle. On exit: teardown
    (engines stopped, logs copied a last time, raw logs and the run's device files removed) on
    every path, interrupts included.
    """

    def __init__(self, scenario: Scenario, scenario_text: str, bundle: Bundle, bundle_dir: Path,
                 progress: Callable[[str], None]) -> None:
        self.scenario = scenario
        self.bundle = bundle
        self.bundle_dir = bundle_dir
        self._progress = progress
        self._text = scenario_text
        self.raw_log_dir = private_temp_path("kvdiag-logs-")  # created once the reaper knows it
        self.device: str | None = None
        self._procs: ProcessSet | None = None
        self.run: ScenarioRun

    def __enter__(self) -> LaunchedRun:
        tally = Tally()
        write_redacted(self.bundle_dir / "scenario.yaml", self._text, tally)
        note_file(self.bundle.redaction, "scenario.yaml", tally.as_dict())
        if self.bundle.environment is not None and not self.bundle.environment.engine_packages:
            # The versions the engines' own interpreters see (a vLLM venv), not only kvdiag's.
            add_engine_packages(self.bundle.environment, engine_interpreters(self.scenario))
        procs = ProcessSet(grace_s=self.scenario.windows.kill_grace_s)
        procs.__enter__()
        self._procs = procs
        try:
            procs.make_private_dir(self.raw_log_dir)  # raw logs are unredacted: never left behind
            procs.on_teardown(self._final_logs)
            self.device = self.scenario.device.name or run_device_name(procs.run_id)
            # Engines log into the private folder; the bundle gets redacted copies.
            self.run = ScenarioRun(self.scenario, self.raw_log_dir, procs, self.device,
                                   progress=lambda m, w: self._progress(m))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def note_interpreters(self) -> None:
        """Record the interpreter of each launched ``command`` engine whose process runs Python
        (``/proc/PID/exe``) and that was not known before launch (a wrapper that ``exec``s a Python)."""
        env = self.bundle.environment
        if env is None:
            return
        known = {name for ip in env.engine_packages for name in ip.engines}
        found: list[tuple[str, str, list[str]]] = []
        for w in self.run.watches:
            pid = w.proc.pid
            if w.spec.kind != "command" or w.spec.name in known or pid is None or not w.proc.alive():
                continue
            try:
                python, extra = interpreter_of_pid(pid)
            except OSError:   # not a Python, gone, or /proc unreadable: nothing to record
                continue
            found.append((w.spec.name, python, extra))
        if found:
            add_engine_packages(env, found)

    def copy_logs(self) -> None:
        """Redacted copies of what the engines printed so far into bundle/logs/."""
        if self.raw_log_dir.exists():
            _copy_logs_redacted(self.raw_log_dir, self.bundle_dir, self.bundle)

    def _final_logs(self) -> None:  # what engines printed until teardown, then no raw copy
        self.copy_logs()
        shutil.rmtree(self.raw_log_dir, ignore_errors=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._procs is not None:
                self._procs.__exit__(exc_type, exc, tb)
        finally:
            if self.raw_log_dir.exists():  # teardown did not get to its hook: copy what is there
                self._final_logs()
            if self.device is not None and self.scenario.device.name is None:
                # The modelled device was this run's own (its name carries the run id): drop its shared
                # lock/accounting files, unless some process still holds them (an engine that would not die).
                remove_unheld(device_file_paths(self.device))


class RunStages(Protocol):
    """What a command puts into the one run: its watch (with its load and its capture on a trigger)
    and the facts it leaves in the bundle."""

    def watch(self, launched: LaunchedRun | None) -> None:
        """Watch the subject until the run's end or its trigger, capturing on it; may be interrupted."""

    def fill(self, bundle: Bundle, interrupted: bool) -> None:
        """Put what the run saw into ``bundle`` (also after an interrupt: the partial report's facts)."""

    def verdict_t(self) -> float:
        """Seconds on the run's clock now (the verdict event's time)."""


@dataclass
class RunPlan:
    """One run: where it writes, its bundle, what it launches (no scenario: a subject already running)."""

    out_dir: Path
    bundle: Bundle
    progress: Callable[[str], None]
    console: Console
    scenario: Scenario | None = None
    scenario_text: str = ""
    stopping: str | None = "stopping engines"   # said with the verdict, before teardown (None: nothing to stop)


def run_lifecycle(plan: RunPlan, stages: Callable[[LaunchedRun | None], RunStages]) -> RunArtifacts:
    """The one run of every command: launch → watch → capture on trigger → analyze → write bundle → render →
    teardown (the output folder is prepared by the command, before anything starts).

    The verdict and the report come before teardown, so the user has them as soon as the evidence is in
    and stopping hung engines (their grace period) adds no delay. Ctrl-C, SIGTERM and SIGHUP
    (:mod:`kvdiag.interrupts`) end it at once: teardown, the partial report (the bundle written once,
    marked interrupted), then :class:`Interrupted`.
    """
    bundle = plan.bundle
    arts: RunArtifacts | None = None
    interrupted: Interrupted | None = None
    run: RunStages | None = None
    filled = False
    try:
        frame = (LaunchedRun(plan.scenario, plan.scenario_text, bundle, plan.out_dir / "bundle", plan.progress)
                 if plan.scenario is not None else nullcontext(None))
        with interrupts.raising(), frame as launched:
            run = stages(launched)
            try:
                run.watch(launched)
            except (Interrupted, KeyboardInterrupt) as exc:
                interrupted = interrupts.as_interrupted(exc)
                bundle.findings.extend(getattr(exc, "capture_findings", []))   # a target capture had to resume
            run.fill(bundle, interrupted is not None)
            filled = True
            if launched is not None:
                launched.copy_logs()
            if interrupted is None:
                arts = finish(plan.out_dir, bundle, verdict_t=run.verdict_t())
                if plan.stopping:
                    plan.progress(f"verdict {arts.verdict.kind.value}; {plan.stopping}")
    except (Interrupted, KeyboardInterrupt) as exc:
        interrupted = interrupted or interrupts.as_interrupted(exc)
    if interrupted is not None or arts is None:
        stop = interrupted or Interrupted("interrupted")
        if run is not None and not filled:   # stopped before the facts were in: the partial report's
            run.fill(bundle, True)
        bundle.interrupted = True
        bundle.interrupted_reason = stop.message
        arts = finish(plan.out_dir, bundle)
        plan.console.print(f"interrupted; partial report written to {plan.out_dir}")
        stop.partial = dataclasses.replace(arts, exit_code=ExitCode.INTERRUPTED)
        raise stop
    return arts


