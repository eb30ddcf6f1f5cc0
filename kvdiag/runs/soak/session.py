"""`kvdiag soak`'s stages in the one run: one engine, saturating streaming load, a no-progress watchdog,
capture on a stall.

Two subjects:
- launched (``--model sim`` or ``--scenario FILE``): the scenario's first engine is started by
  the run (:func:`kvdiag.runs.lifecycle.run_lifecycle`: own process group, reaper, torn down on every
  exit path), watched until ready by :class:`ScenarioRun`, then loaded;
- external (``--url URL``): an already running server is loaded; when it listens on this
  machine its pid is found from the listening socket so a stall can still be captured.

On a stall the engine is captured while the stalled requests are still in flight; the
verdict and report are written before anything is torn down.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvdiag.capture.bundle import engine_pids
from kvdiag.capture.locate import is_local_host, local_server, url_host_port
from kvdiag.defaults import DEFAULT_TOOLS, STALL_WINDOW_S, TOOL_TIMEOUT_S, Clock
from kvdiag.errors import EngineFailed, KvdiagError
from kvdiag.load.loadgen import LoadGenerator
from kvdiag.load.stats import SoakSummary
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import EnginePhase, ProcessRole
from kvdiag.model.run import EngineRecord, Finding, MetricsSnapshot, SoakStats, TimelineEvent
from kvdiag.model.verdict import Diagnosis
from kvdiag.runs.capture import capture_evidence
from kvdiag.runs.engines import EngineWatch, Outcome
from kvdiag.runs.lifecycle import LaunchedRun, RunPlan, new_bundle, run_lifecycle
from kvdiag.runs.output import RunArtifacts
from kvdiag.runs.soak.drive import DriveResult, LoadPhase
from kvdiag.runs.soak.options import SoakOptions, load_soak_scenario, request_model, single_engine
from kvdiag.runs.soak.subject import Subject, served_model, server_answers
from kvdiag.scenario.models import Scenario

COMMAND = "soak"


class SoakRun:
    """One soak run from launch to report. Create, then :meth:`run`."""

    def __init__(self, opts: SoakOptions, out_dir: Path, console: Console, clock: Clock = time.monotonic) -> None:
        opts.validate()
        self.opts = opts
        self.out_dir = out_dir
        self.bundle_dir = out_dir / "bundle"
        self.console = console
        self.clock = clock
        self.t0 = clock()
        self.bundle: Bundle = new_bundle(COMMAND)
        self.timeline: list[TimelineEvent] = []
        self.metrics: list[MetricsSnapshot] = []
        self.findings: list[Finding] = []
        self.processes: list[ProcessEvidence] = []
        self.scenario: Scenario | None = None
        self.window_s = opts.stall_window_s or STALL_WINDOW_S
        self.tools: list[str] = list(opts.tools or DEFAULT_TOOLS)
        self.tool_timeout_s = TOOL_TIMEOUT_S
        self.result = DriveResult()
        self._load: LoadPhase | None = None
        self._launched: LaunchedRun | None = None
        self._subject: Subject | None = None        # an external server
        self._watch: EngineWatch | None = None        # a launched engine
        self._run_timeline_taken = False

    # -- helpers -----------------------------------------------------------------------------------
    def _rel(self, t: float) -> float:
        return round(t - self.t0, 3)

    def event(self, event: str, detail: str | None = None, engine: str | None = None, at: float | None = None,
              echo: bool = True) -> None:
        t = self._rel(self.clock() if at is None else at)
        self.timeline.append(TimelineEvent(t=t, event=event, engine=engine, detail=detail))
        if echo:
            msg = f"{engine + ': ' if engine else ''}{event}{' (' + detail + ')' if detail else ''}"
            self.console.print(f"[dim]{t:6.1f}s[/dim] {escape(msg)}", highlight=False)

    # -- entry -------------------------------------------------------------------------------------
    def run(self) -> RunArtifacts:
        """Run the soak; returns the written report's artifacts. Raises Interrupted (after writing a
        partial report) on Ctrl-C/SIGTERM."""
        if self.opts.url is not None:
            plan = self._plan_external(self.opts.url)
        else:
            plan = self._plan_launched()
        arts = run_lifecycle(plan, self._stages)
        if self.result.all_failing:
            lg = self.loadgen
            raise KvdiagError(f"every request failed: {lg.first_error if lg else 'unknown error'}",
                              hint=f"report written to {self.out_dir}; check --model, --url and the server log")
        return arts

    def _stages(self, launched: LaunchedRun | None) -> SoakRun:
        self._launched = launched
        if launched is not None:
            self.t0 = launched.run.t0
        return self

    # -- the run's stages (kvdiag.runs.lifecycle.RunStages) ------------------------------------------------
    def watch(self, launched: LaunchedRun | None) -> None:
        """Launched: watch the engine until it is ready, then load it; external: load it. A stall under load
        is captured while its requests are still in flight."""
        if launched is None:
            assert self._subject is not None
            self._drive(self._subject)
            return
        run, spec = launched.run, launched.scenario.engines[0]
        result = run.run()
        launched.note_interpreters()
        self.timeline.extend(run.timeline)
        self._run_timeline_taken = True
        self.metrics.extend(result.metrics)
        watch = self._watch = result.watches[0] if result.watches else None
        if watch is not None and watch.outcome is Outcome.READY:
            self._drive(Subject(name=spec.name, url=watch.plan.url, allocator=spec.allocator, watch=watch,
                                 root_pid=watch.proc.pid, request_model=request_model(spec)))
        elif watch is not None and watch.outcome is Outcome.STALLED and self.opts.capture:
            # The engine never came up: capture its startup hang like `repro` does.
            self._capture(Subject(name=spec.name, url=watch.plan.url, allocator=spec.allocator, watch=watch,
                                   root_pid=watch.proc.pid, log_pids=dict(watch.state.pids)))

    def fill(self, bundle: Bundle, interrupted: bool) -> None:
        """The engine's record, the load's figures and readings, metrics, captures and timeline."""
        launched = self._launched
        if launched is not None:
            if not self._run_timeline_taken:
                self.timeline.extend(e for e in launched.run.timeline if e not in self.timeline)
                self._run_timeline_taken = True
            if self._watch is None and launched.run.watches:
                self._watch = launched.run.watches[0]
            self._fill_launched(self._watch)
        elif self._subject is not None:
            self._fill_external(self._subject)
        if interrupted and self.loadgen is not None and self.result.summary is None:
            self.result.summary = self.loadgen.summary()
        self._fill_common()

    def verdict_t(self) -> float:
        return self.clock() - self.t0

    # -- launched engine ---------------------------------------------------------------------------
    def _plan_launched(self) -> RunPlan:
        opts = self.opts
        base, name, text = load_soak_scenario(opts.scenario, opts.model)
        scen = single_engine(base, opts.allocator, opts.stall_window_s)
        self.scenario = scen
        self.window_s = scen.windows.stall_s
        if opts.tools is None:
            self.tools = list(scen.capture.tools)
        self.tool_timeout_s = scen.capture.tool_timeout_s
        if scen.capture.when == "never":
            opts.capture = False
        self.bundle.scenario = scen.model_dump(mode="json")
        self.bundle.scenario_path = name
        self.bundle_dir.mkdir(parents=True, exist_ok=True)
        return RunPlan(self.out_dir, self.bundle, self._echo, self.console, scen, text, stopping="stopping the engine")

    def _fill_launched(self, watch: EngineWatch | None) -> None:
        b = self.bundle
        if watch is not None:
            if self.result.stalled:
                watch.outcome = Outcome.STALLED
            elif self.result.exited:
                watch.outcome = Outcome.EXITED
            if self.result.healthy_after is not None:
                watch.healthy = self.result.healthy_after
            b.engines = [watch.record(f"logs/{watch.spec.name}.log")]
            if watch.outcome is Outcome.STALLED and watch.quiet_since_t is not None and not self.result.stalled:
                # a startup stall, seen by ScenarioRun
                self.timeline.append(TimelineEvent(t=self._rel(watch.quiet_since_t),
                                                   event="stall onset (last progress)", engine=watch.spec.name))
            b.stall_detected = watch.outcome is Outcome.STALLED

    # -- external server ---------------------------------------------------------------------------
    def _plan_external(self, url: str) -> RunPlan:
        url = url.rstrip("/")
        host, port = url_host_port(url)
        name = "server"
        self.bundle.stall_window_s = self.window_s
        subject = Subject(name=name, url=url, allocator="external")
        if not server_answers(url):
            raise EngineFailed(f"no server answers at {url} (GET /health and /v1/models failed)",
                               hint="start the server first, or leave out --url to launch the simulated engine")
        self.event("server answers", url, engine=name)
        if self.opts.model != "sim":
            subject.request_model = self.opts.model
        else:
            subject.request_model = served_model(url)
        if is_local_host(host):
            pid = local_server(url)
            if pid is not None:
                subject.root_pid = pid
                subject.log_pids = {"api_server": pid}
                self.event("server process found", f"pid {pid} listens on port {port}", engine=name)
            else:
                self.findings.append(Finding(kind="capture_unavailable", engine=name, message=(
                    f"no process on this machine visibly listens on port {port} (another user's process or a "
                    "container?); a stall can be reported but not captured")))
        else:
            self.findings.append(Finding(kind="capture_unavailable", engine=name, message=(
                f"{host} is not this machine; a stall can be reported from /metrics but stacks cannot be captured "
                "(run kvdiag soak on the server's host)")))
        self._subject = subject
        # Nothing is launched: the run has no engines to stop.
        return RunPlan(self.out_dir, self.bundle, self._echo, self.console, stopping=None)

    def _fill_external(self, s: Subject) -> None:
        r = self.result
        phase = EnginePhase.STALLED if r.stalled else (EnginePhase.EXITED if r.unreachable else EnginePhase.SERVING)
        pids = dict(s.log_pids)
        for ev in self.processes:
            if ev.role is ProcessRole.ENGINE_CORE:
                pids.setdefault("engine_core", ev.pid)
        self.bundle.engines = [EngineRecord(
            name=s.name, allocator="external", phase=phase, url=s.url,
            healthy=bool(r.healthy_after) if r.healthy_after is not None else not r.unreachable, pids=pids,
            error=f"server at {s.url} stopped answering during the soak" if r.unreachable else None)]
        self.bundle.stall_detected = r.stalled

    # -- the load ----------------------------------------------------------------------------------
    def _drive(self, s: Subject) -> None:
        self._load = LoadPhase(self.opts, self.window_s, self.t0, self.clock, self.console, self.event,
                               self._capture, self.result, self.metrics, self.findings)
        self._load.drive(s)

    @property
    def loadgen(self) -> LoadGenerator | None:
        """The load phase's generator (None before the load started)."""
        return self._load.loadgen if self._load is not None else None

    # -- capture -----------------------------------------------------------------------------------
    def _capture(self, s: Subject) -> None:
        """Read-only capture of the engine's EngineCore, API server and workers into the bundle."""
        if s.root_pid is None:
            return
        log_pids = dict(s.watch.state.pids) if s.watch is not None else dict(s.log_pids)
        self.event("capturing", f"{s.name} (pid {s.root_pid} and its engine processes) with "
                   f"{', '.join(self.tools)}", engine=s.name)
        try:
            # The one capture of a running engine (kvdiag.runs.capture): its EngineCore first, its early verdict
            # said at once; the report's verdict is judged later, with the load's figures.
            captured, _ = capture_evidence(s.root_pid, engine_pids(s.root_pid, log_pids), self.bundle_dir,
                                           timeout_s=self.tool_timeout_s, tools=self.tools, command=COMMAND,
                                           log_pids=log_pids, on_verdict=self._said,
                                           progress=self._echo)
        except BaseException as exc:   # interrupted mid-capture: the partial report says what was resumed
            self.findings.extend(getattr(exc, "capture_findings", []))
            raise
        for ev in captured.processes:
            ev.engine = s.name
        for f in captured.findings:
            f.engine = f.engine or s.name
        self.processes.extend(captured.processes)
        self.findings.extend(captured.findings)
        self.event("capture finished", f"{len(captured.processes)} process(es)", engine=s.name)

    def _said(self, diagnosis: Diagnosis) -> None:
        v = diagnosis.verdict
        self._echo(f"the stacks say: {v.kind.value} ({v.confidence.value} confidence)")

    # -- verdict and report ------------------------------------------------------------------------
    def _fill_common(self) -> None:
        b = self.bundle
        b.stall_window_s = self.window_s
        b.metrics = sorted(self.metrics, key=lambda m: m.t)
        b.processes = list(self.processes)
        b.findings = list(self.findings)
        if self.result.summary is not None:
            b.soak = self._soak_stats(self.result.summary)
            b.soak.server_unreachable = self.result.unreachable
            b.soak.all_requests_failed = self.result.all_failing
        b.timeline = sorted(self.timeline, key=lambda e: e.t)

    def _soak_stats(self, summary: SoakSummary) -> SoakStats:
        """The bundle's SoakStats: the client's summary plus the load phase, scrapes and saturation."""
        st = summary.to_soak_stats()
        r, opts = self.result, self.opts
        st.requested_duration_s = opts.duration_s
        st.drain_grace_s = opts.drain_grace_s
        st.metrics_period_s = opts.metrics_period_s
        st.in_flight_at_end = r.in_flight_at_end
        st.series = list(r.series)
        if r.scrapes is not None:
            st.metrics_scrapes, st.metrics_failures, gap = r.scrapes
            st.metrics_longest_gap_s = None if gap is None else round(gap, 3)
        sat = r.saturation
        if sat is not None:   # the readings; analyze judges saturation from them and the loaded time's /metrics
            def r3(v: float | None) -> float | None:
                return None if v is None else round(v, 3)

            st.streams_requested = sat.requested
            st.streams_in_flight_mean = r3(sat.in_flight_mean)
            st.client_cpu, st.server_cpu = r3(sat.client_cpu), r3(sat.server_cpu)
            st.machine_cpu_busy = r3(sat.machine_busy)
            st.load_from_t, st.load_until_t = r.load_window or (None, None)
        return st

    def _echo(self, msg: str) -> None:
        self.console.print(f"[dim]{self.clock() - self.t0:6.1f}s[/dim] {escape(msg)}", highlight=False)


def run_soak(opts: SoakOptions, out_dir: Path, console: Console) -> RunArtifacts:
    """Run `kvdiag soak` with ``opts`` and write the report into ``out_dir``."""
    return SoakRun(opts, out_dir, console).run()


__all__ = ["SoakRun", "run_soak"]
