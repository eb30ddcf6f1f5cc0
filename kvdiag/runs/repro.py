"""`kvdiag repro` and `kvdiag ab` as runs: a scenario's engines launched and watched, captured on a stall
(:class:`_ScenarioStages` inside :func:`kvdiag.runs.lifecycle.run_lifecycle`), and what repro, ab and sweep
check before any folder or engine exists (:func:`launchable`)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvdiag.analyze.diagnosis import AB_SIDES
from kvdiag.capture.bundle import capture_engine
from kvdiag.errors import UsageError
from kvdiag.kvcached.runtime import collect_runtime
from kvdiag.launch.preflight import check_launchable
from kvdiag.model.bundle import Bundle
from kvdiag.model.run import TimelineEvent
from kvdiag.runs.engines import EngineWatch, Outcome, RunResult
from kvdiag.runs.lifecycle import LaunchedRun, RunPlan, RunStages, new_bundle, run_lifecycle
from kvdiag.runs.outdir import prepare_out_dir
from kvdiag.runs.output import RunArtifacts, finish
from kvdiag.scenario.loader import load_scenario
from kvdiag.scenario.models import Scenario


def launchable(path: Path | None, switching: str | None = None) -> tuple[Scenario, str, str]:
    """The scenario at ``path`` (None: the embedded default) as (scenario, name, text), refused before
    anything starts when it cannot run here; ``switching``: the command that switches its allocator."""
    scen, name, text = load_scenario(path)
    check_launchable(scen, name, text)
    if switching is not None:
        switchable(scen, switching)
    return scen, name, text


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
