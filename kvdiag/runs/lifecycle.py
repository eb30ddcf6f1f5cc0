"""Sequence the pipeline for scenario commands: launch → watch → capture → analyze → report.

CLI modules stay thin and call in here; every stage is reached only through
its package's public functions and the Bundle passed between them.
"""

from __future__ import annotations

import copy
import datetime as _dt
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

from rich.console import Console
from rich.markup import escape

from kvdiag import __version__, interrupts
from kvdiag.allocator import remove_device_files
from kvdiag.capture.bundle import capture_engine
from kvdiag.environment import add_engine_packages, collect_environment
from kvdiag.environment.host import host_record
from kvdiag.environment.interpreter import interpreter_of_pid
from kvdiag.errors import Interrupted, UsageError
from kvdiag.kvcached.runtime import collect_runtime
from kvdiag.launch.interpreters import engine_interpreters
from kvdiag.launch.process import ProcessSet, private_temp_path
from kvdiag.launch.reaper import run_device_name
from kvdiag.model import (
    Bundle,
    TimelineEvent,
)
from kvdiag.redact import Tally, copy_redacted, note_file, write_redacted
from kvdiag.runs.engines import EngineWatch, Outcome, RunResult, ScenarioRun
from kvdiag.runs.output import RunArtifacts, finish, prepare_out_dir
from kvdiag.scenario.models import Scenario


def new_bundle(command: str) -> Bundle:
    return Bundle(kvdiag_version=__version__, command=command, host=host_record(),
                  created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  environment=collect_environment())


def _capture_engines(watches: list[EngineWatch], bundle_dir: Path, tools: list[str], timeout_s: float,
                     bundle: Bundle) -> None:
    """Capture every process of each given engine into the bundle (read-only)."""
    for w in watches:
        if w.proc.pid is None:
            continue
        evidence, findings = capture_engine(w.spec.name, w.proc.pid, bundle_dir, timeout_s=timeout_s,
                                            backends=tools, log_pids=dict(w.state.pids))
        bundle.processes.extend(evidence)
        bundle.findings.extend(findings)
    if bundle.environment is not None:
        # kvcached's segments and worker sockets as they are while the engines hang (not at launch).
        try:
            bundle.environment.kvcached_runtime = collect_runtime()
        except OSError as exc:
            bundle.environment.errors.append(f"kvcached runtime at capture: {exc}")


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
                # The modelled device was this run's own: drop its shared lock/accounting files.
                remove_device_files(self.device)


def switchable(scenario: Scenario, what: str) -> None:
    """Refuse an allocator override (``repro --allocator``, ``ab``) when some engine's allocator is not
    kvdiag's to switch: a `kind: command` engine, or `allocator: external` (vLLM's own or kvcached).
    Both sides would run the same setup and the comparison would be of nothing."""
    fixed = [f"{e.name} ({'kind: command' if e.kind == 'command' else 'allocator: external'})"
             for e in scenario.engines if not (e.kind in ("sim", "vllm") and e.allocator != "external")]
    if fixed:
        raise UsageError(f"{what} switches kvdiag's allocator, which engine(s) {', '.join(fixed)} do not use: "
                         "both sides would run the same setup",
                         hint="use engines of kind sim, or kind vllm with allocator: stock|fixed (kvdiag's "
                              "plugin); run the scenario without the switch to diagnose it as it is")


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
        raise stop
    return arts


class _ScenarioStages:
    """`repro` (and each side of `ab`): the scenario's engines in order, watched until each is ready,
    stalls, dies or times out; the stalled ones (or, ``capture.when: always``, every live one) captured."""

    def __init__(self, scenario: Scenario, launched: LaunchedRun, progress: Callable[[str], None]) -> None:
        self.scenario = scenario
        self.launched = launched
        self.progress = progress
        self.run = launched.run
        self.result: RunResult | None = None

    def watch(self, launched: LaunchedRun | None) -> None:
        run, scenario = self.run, self.scenario
        self.result = result = run.run()
        when = scenario.capture.when
        targets = (result.stalled if when == "stall" else
                   [w for w in result.watches if w.proc.alive()] if when == "always" else [])
        if targets:
            self.progress(f"capturing {', '.join(w.spec.name for w in targets)} "
                          f"({', '.join(scenario.capture.tools)})")
            _capture_engines(targets, self.launched.bundle_dir, list(scenario.capture.tools),
                             scenario.capture.tool_timeout_s, self.launched.bundle)
            run.timeline.append(TimelineEvent(t=round(time.monotonic() - run.t0, 3), event="capture finished"))
        self.launched.note_interpreters()   # after capture: asking an interpreter must not delay it

    def fill(self, bundle: Bundle, interrupted: bool) -> None:
        run = self.run
        _fill_bundle(bundle, self.result if self.result is not None and not interrupted
                     else RunResult(run.watches, run.timeline, run.metrics, run.t0))

    def verdict_t(self) -> float:
        return time.monotonic() - self.run.t0


def run_scenario(scenario: Scenario, scenario_name: str, scenario_text: str, out_dir: Path, command: str,
                 console: Console, allocator: str | None = None,
                 on_event: Callable[[str], None] | None = None) -> RunArtifacts:
    """Run a co-location scenario end to end and write its report into ``out_dir``."""
    if allocator is not None:
        switchable(scenario, f"--allocator {allocator}")
        for e in scenario.engines:
            e.allocator = allocator  # type: ignore[assignment]
    bundle = new_bundle(command)
    bundle.scenario = scenario.model_dump(mode="json")
    bundle.scenario_path = scenario_name
    bundle.stall_window_s = scenario.windows.stall_s
    started = time.monotonic()

    def progress(msg: str) -> None:
        console.print(f"[dim]{time.monotonic() - started:6.1f}s[/dim] {_esc(msg)}", highlight=False, markup=True)
        if on_event:
            on_event(msg)

    def stages(launched: LaunchedRun | None) -> RunStages:
        assert launched is not None
        return _ScenarioStages(scenario, launched, progress)

    return run_lifecycle(RunPlan(out_dir, bundle, progress, console, scenario, scenario_text), stages)


def _fill_bundle(bundle: Bundle, result: RunResult) -> None:
    """Engine records and timeline, taken while processes still exist (pids, exit codes)."""
    bundle.engines = [w.record(f"logs/{w.spec.name}.log") for w in result.watches]
    bundle.timeline = list(result.timeline)
    bundle.metrics = list(result.metrics)
    bundle.stall_detected = bool(result.stalled)
    for w in result.watches:
        if w.outcome is Outcome.STALLED and w.quiet_since_t is not None:
            bundle.timeline.append(TimelineEvent(t=round(w.quiet_since_t - result.t0, 3),
                                                 event="stall onset (last progress)", engine=w.spec.name))
    bundle.timeline.sort(key=lambda e: e.t)


def _esc(text: str) -> str:
    return escape(text)


AB_SIDES = ("stock", "fixed")


def run_ab(scenario: Scenario, scenario_name: str, scenario_text: str, out_dir: Path, console: Console,
           on_side: Callable[[str, RunArtifacts], None] | None = None) -> RunArtifacts:
    """`kvdiag ab`: the scenario once per allocator, each a full run nested in ``out_dir/<side>/``.

    The A/B bundle names both nested bundles (``runs``); its diagnosis (the comparison) is
    computed from them by analyze, so `kvdiag analyze/report` on the A/B folder says the same.
    """
    switchable(scenario, "kvdiag ab")
    sides: dict[str, RunArtifacts] = {}
    for allocator in AB_SIDES:
        console.rule(f"{allocator} allocator")
        sub = prepare_out_dir(out_dir / allocator, f"ab {allocator}")
        sides[allocator] = run_scenario(copy.deepcopy(scenario), scenario_name, scenario_text, sub,
                                        f"ab ({allocator})", console, allocator=allocator)
        if on_side is not None:
            on_side(allocator, sides[allocator])
    bundle = new_bundle("ab")
    bundle.scenario = scenario.model_dump(mode="json")
    bundle.scenario_path = scenario_name
    bundle.stall_window_s = scenario.windows.stall_s
    bundle.runs = {side: f"../{side}/bundle" for side in AB_SIDES}
    bundle.engines = [e.model_copy(update={"name": f"{side}/{e.name}"})
                      for side, arts in sides.items() for e in arts.bundle.engines]
    bundle.findings = [f for arts in sides.values() for f in arts.bundle.findings]
    first = next(iter(sides.values())).bundle.environment
    if bundle.environment is not None and first is not None:
        bundle.environment.engine_packages = list(first.engine_packages)  # both sides run the same engines
    return finish(out_dir, bundle, runs={side: arts.bundle for side, arts in sides.items()})
