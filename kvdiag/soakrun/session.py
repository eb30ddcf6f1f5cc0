"""`kvdiag soak`'s stages in the one run: one engine, saturating streaming load, a no-progress watchdog,
capture on a stall.

Two subjects:
- launched (``--model sim`` or ``--scenario FILE``): the scenario's first engine is started by
  the run (:func:`kvdiag.runner.run_lifecycle`: own process group, reaper, torn down on every
  exit path), watched until ready by :class:`ScenarioRun`, then loaded;
- external (``--url URL``): an already running server is loaded; when it listens on this
  machine its pid is found from the listening socket so a stall can still be captured.

On a stall the engine is captured while the stalled requests are still in flight; the
verdict and report are written before anything is torn down.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape

from kvdiag import interrupts
from kvdiag.analyze.soak import flat_generation_span
from kvdiag.capture.bundle import capture_engine
from kvdiag.defaults import DEFAULT_TOOLS, STALL_WINDOW_S, TOOL_TIMEOUT_S
from kvdiag.errors import EngineFailed, Interrupted, KvdiagError
from kvdiag.load.loadgen import LoadConfig, LoadGenerator
from kvdiag.load.procnet import is_local_host, server_pid, url_host_port
from kvdiag.load.progress import ProgressView
from kvdiag.load.stats import SoakSummary
from kvdiag.logs.lines import feed_line
from kvdiag.model import (
    Bundle,
    EnginePhase,
    EngineRecord,
    Finding,
    MetricsSnapshot,
    ProcessEvidence,
    ProcessRole,
    SoakSample,
    SoakStats,
    TimelineEvent,
)
from kvdiag.osread.net import listening_pids
from kvdiag.runner import LaunchedRun, RunArtifacts, RunPlan, new_bundle, run_lifecycle
from kvdiag.scenario.models import Scenario
from kvdiag.scenariorun import EngineWatch, Outcome
from kvdiag.soakrun.options import SoakOptions, load_soak_scenario, request_model, single_engine
from kvdiag.soakrun.subject import Subject, healthy, served_model, server_answers, server_pids
from kvdiag.watch.saturation import SaturationSampler
from kvdiag.watch.watchdog import MetricsPoller, NoProgressWatchdog

Clock = Callable[[], float]
COMMAND = "soak"
_TICK_S = 0.25
_SAMPLE_S = 0.5          # the client's counters, for the report's plots
_MAX_SAMPLES = 4000


@dataclass
class _DriveResult:
    stalled: bool = False
    onset_t: float | None = None              # monotonic clock
    fired_t: float | None = None
    exited: bool = False
    unreachable: bool = False
    all_failing: bool = False
    summary: SoakSummary | None = None
    healthy_after: bool | None = None
    saturation: SaturationSampler | None = None
    load_window: tuple[float, float] | None = None    # run clock, s
    scrapes: tuple[int, int, float | None] | None = None   # (scrapes, failures, longest gap s)
    series: list[SoakSample] = field(default_factory=list)   # the client's counters over time
    in_flight_at_end: int | None = None


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
        self.interrupted: Interrupted | None = None
        self.scenario: Scenario | None = None
        self.window_s = opts.stall_window_s or STALL_WINDOW_S
        self.tools: list[str] = list(opts.tools or DEFAULT_TOOLS)
        self.tool_timeout_s = TOOL_TIMEOUT_S
        self.loadgen: LoadGenerator | None = None
        self.result = _DriveResult()
        self.load_started_t: float | None = None
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

    # -- the run's stages (kvdiag.runner.RunStages) ------------------------------------------------
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
            pid = server_pid(listening_pids(port))
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
        """Run the load phase on a fresh event loop; signals become a clean stop."""
        asyncio.run(self._drive_async(s))
        if self.interrupted is not None:
            raise self.interrupted

    async def _drive_async(self, s: Subject) -> None:
        wake = asyncio.Event()

        def stop(reason: str) -> None:   # the loop ends at its next tick; the load is stopped cleanly
            if self.interrupted is None:
                self.interrupted = Interrupted(reason)
            wake.set()

        with interrupts.on_stop(stop, loop=asyncio.get_running_loop()):
            await self._load_and_watch(s, wake)

    async def _load_and_watch(self, s: Subject, wake: asyncio.Event) -> None:
        opts = self.opts
        cfg = LoadConfig(base_url=s.url, model=s.request_model, concurrency=opts.concurrency,
                         max_tokens=opts.max_tokens, chat=opts.chat, read_timeout_s=opts.read_timeout_s)
        lg = LoadGenerator(cfg, clock=self.clock)
        self.loadgen = lg
        poller = MetricsPoller(s.url, s.name, self.t0, clock=self.clock, period_s=opts.metrics_period_s)
        # A tick that comes late (this loop starved of CPU) is a gap in looking, not a stall.
        watchdog = NoProgressWatchdog(self.window_s, clock=self.clock, max_blind_s=4 * _TICK_S)
        view = ProgressView(self.console)
        sampler = SaturationSampler(opts.concurrency, server_pids(s), clock=self.clock)
        r = self.result
        lg.start(opts.duration_s)   # no new request after the duration, however late this loop looks
        self.load_started_t = lg.started_at
        self.event("soak load started", f"{opts.concurrency} streams x {opts.max_tokens} tokens to {s.url}"
                   f"{cfg.endpoint}, {opts.duration_s:g}s, stall window {self.window_s:g}s", engine=s.name)
        poller.start()   # own thread and timer: scrapes never wait behind the load's event loop
        drain_until: float | None = None
        health = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(2.0))
        health_failures = 0
        view.start()
        try:
            while True:
                now = self.clock()
                tick = _TICK_S
                if drain_until is None and lg.load_deadline is not None:
                    tick = max(0.0, min(tick, lg.load_deadline - now))
                elif drain_until is not None:
                    tick = max(0.0, min(tick, drain_until - now))
                try:
                    await asyncio.wait_for(wake.wait(), timeout=tick)
                except asyncio.TimeoutError:
                    pass
                if self.interrupted is not None:
                    break
                now = self.clock()
                if s.watch is not None and self._engine_exited(s):
                    r.exited = True
                    break
                if watchdog.observe(lg.in_flight, lg.progress, lg.last_progress_t):
                    r.stalled = True
                    r.onset_t, r.fired_t = watchdog.onset, watchdog.fired_at
                    break
                if lg.ok == 0 and lg.tokens == 0 and lg.failed + lg.timed_out >= 2 * opts.concurrency:
                    r.all_failing = True
                    break
                if s.watch is None and lg.failed > 0 and poller.failures > 0:
                    # External server: refused connections and no /metrics: is it still there?
                    health_failures = 0 if await healthy(health, s.url) else health_failures + 1
                    if health_failures >= 3:
                        r.unreachable = True
                        break
                self._sample(now, lg)
                view.update(now - self.t0, lg, poller.latest, watchdog.quiet_for,
                            fresh_after=None if lg.started_at is None else lg.started_at - self.t0)
                if drain_until is None:
                    if lg.warmed_up:
                        if not sampler.started:
                            sampler.start()
                        sampler.tick(lg.in_flight)
                    if lg.past_deadline():
                        # The stated duration is over: no new request; those in flight may finish.
                        sampler.stop()
                        start = lg.drain_started_at if lg.drain_started_at is not None else now
                        drain_until = start + opts.drain_grace_s
                        self.event("soak duration reached", f"{lg.drain_in_flight} request(s) in flight, up to "
                                   f"{opts.drain_grace_s:g}s to finish", engine=s.name, at=lg.load_deadline,
                                   echo=False)
                if drain_until is not None and (lg.drained() or now >= drain_until):
                    if not lg.drained():
                        await lg.stop()   # the grace is over: cancel the rest now (bounded)
                    break
            view.stop()
            r.in_flight_at_end = lg.in_flight
            self._sample(self.clock(), lg, force=True)
            lg.end_load(at=r.fired_t if r.stalled else None)   # a stall, exit, error: loaded until now
            sampler.stop()
            await asyncio.to_thread(poller.stop)
            r.scrapes = (poller.scrapes, poller.failures, poller.longest_gap_s)
            r.saturation = sampler
            r.load_window = self._load_window(lg)
            if r.stalled and self.interrupted is None:
                assert r.onset_t is not None
                self.event("stall detected", f"{lg.in_flight} requests in flight, no token for {self.window_s:g}s; "
                           f"{lg.tokens} tokens so far", engine=s.name)
                self.event("stall onset (last progress)", engine=s.name, at=r.onset_t, echo=False)
                await self._confirm_metrics(poller)
                if self.opts.capture and s.root_pid is not None:
                    await asyncio.to_thread(self._capture, s)
                r.healthy_after = await healthy(health, s.url)
            elif r.exited:
                self.event("engine exited during the soak", engine=s.name)
            elif r.all_failing:
                self.event("every request failed", lg.first_error, engine=s.name)
            elif r.unreachable:
                self.event("server stopped answering", poller.last_error, engine=s.name)
            else:
                await lg.stop()   # cut what the drain left, before the probes below
                r.healthy_after = await healthy(health, s.url)
                if self.interrupted is None:
                    await poller.poll_async()  # the gauges at the end
        finally:
            view.stop()
            await lg.stop()
            await poller.aclose()
            await health.aclose()
            self.metrics.extend(poller.snapshots)
        stall_after = (r.onset_t - lg.started_at) if r.stalled and r.onset_t is not None and lg.started_at else None
        r.summary = lg.summary(stalled=r.stalled, stall_after_s=stall_after)
        if not r.stalled:
            sm = r.summary
            drain = ("" if sm.drain_s is None else
                     f"; drain {sm.drain_s:.1f}s: {(sm.drain_in_flight or 0) - (sm.drain_cut or 0)} of "
                     f"{sm.drain_in_flight} in-flight request(s) finished, {sm.drain_cut} cancelled")
            self.event("soak load stopped", f"loaded {sm.duration_s:.1f}s of {opts.duration_s:g}s{drain}; "
                       f"{sm.tokens} tokens, {sm.requests_ok} requests ok", engine=s.name,
                       at=lg.drain_ended_at or lg.load_ended_at)
        if lg.failed or lg.timed_out:
            self.findings.append(Finding(kind="requests_failed", engine=s.name, message=(
                f"{lg.failed} request(s) failed and {lg.timed_out} timed out; first error: {lg.first_error}")))

    def _sample(self, now: float, lg: LoadGenerator, force: bool = False) -> None:
        """The client's counters for the report's plots, every :data:`_SAMPLE_S` (bounded: a long soak
        keeps every other one of its older samples)."""
        series = self.result.series
        last = series[-1] if series else None
        t = round(now - self.t0, 3)
        if last is not None and not force and t - last.t < _SAMPLE_S:
            return
        rate = None
        if last is not None and t > last.t:
            rate = round((lg.tokens - last.tokens) / (t - last.t), 1)
        series.append(SoakSample(t=t, tokens=lg.tokens, tokens_per_s=rate, in_flight=lg.in_flight, ok=lg.ok,
                                 failed=lg.failed + lg.timed_out))
        if len(series) > _MAX_SAMPLES:
            del series[: len(series) // 2 : 2]

    def _load_window(self, lg: LoadGenerator) -> tuple[float, float]:
        """The loaded time (and its drain) on the run's clock: the snapshots taken so far within it are the
        ones saturation is judged from (those of the stall's confirmation come later)."""
        lo = (lg.started_at if lg.started_at is not None else self.t0) - self.t0
        return lo, math.ceil((self.clock() - self.t0) * 1000) / 1000

    async def _confirm_metrics(self, poller: MetricsPoller) -> None:
        """Scrape until the server's own token counter has been flat for the window (bounded).

        The watchdog fires one window after the last token; the first flat scrape came up to a
        poll period later, so a few more scrapes let /metrics show the whole window."""
        budget = self.clock() + min(self.window_s, 3.0) + 1.0
        while self.clock() < budget and self.interrupted is None:
            snap = await poller.poll_async()
            if snap is None and poller.failures >= 3:
                self.findings.append(Finding(kind="metrics_unavailable", message=(
                    f"/metrics did not answer during the stall: {poller.last_error}")))
                return
            if flat_generation_span(poller.snapshots) >= self.window_s + 0.05:
                return
            await asyncio.sleep(_TICK_S)

    def _engine_exited(self, s: Subject) -> bool:
        w = s.watch
        assert w is not None
        for line in w.follower.read_new():
            for ev in feed_line(w.state, line, w.spec.name):
                self.event(ev, engine=w.spec.name, echo=False)
        rc = w.proc.returncode()
        if rc is not None:
            w.healthy = False
            self.event("engine exited", f"exit code {rc}", engine=w.spec.name)
            return True
        return False

    # -- capture -----------------------------------------------------------------------------------
    def _capture(self, s: Subject) -> None:
        """Read-only capture of the engine's EngineCore, API server and workers into the bundle."""
        if s.root_pid is None:
            return
        log_pids = dict(s.watch.state.pids) if s.watch is not None else dict(s.log_pids)
        self.event("capturing", f"{s.name} (pid {s.root_pid} and its engine processes) with "
                   f"{', '.join(self.tools)}", engine=s.name)
        try:
            evidence, findings = capture_engine(s.name, s.root_pid, self.bundle_dir, timeout_s=self.tool_timeout_s,
                                                backends=self.tools, log_pids=log_pids)
        except BaseException as exc:   # interrupted mid-capture: the partial report says what was resumed
            self.findings.extend(getattr(exc, "capture_findings", []))
            raise
        self.processes.extend(evidence)
        self.findings.extend(findings)
        self.event("capture finished", f"{len(evidence)} process(es)", engine=s.name)

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
