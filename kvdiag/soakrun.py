"""`kvdiag soak`: one engine, saturating streaming load, a no-progress watchdog, capture on a stall.

Two subjects:
- launched (``--model sim`` or ``--scenario FILE``): the scenario's first engine is started
  through :class:`ProcessSet` (own process group, reaper, torn down on every exit path),
  watched until ready by :class:`ScenarioRun`, then loaded;
- external (``--url URL``): an already running server is loaded; when it listens on this
  machine its pid is found from the listening socket so a stall can still be captured.

On a stall the engine is captured while the stalled requests are still in flight; the
verdict and report are written before anything is torn down.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape

from kvdiag.analyze.soak import flat_generation_span
from kvdiag.capture.bundle import capture_engine
from kvdiag.defaults import DEFAULT_TOOLS, STALL_WINDOW_S, TOOL_TIMEOUT_S
from kvdiag.errors import EngineFailed, Interrupted, KvdiagError, UsageError
from kvdiag.launch.process import ProcessSet
from kvdiag.launch.vllm import expand
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
from kvdiag.osread.ptable import process_tree
from kvdiag.runner import LaunchedRun, RunArtifacts, finish, new_bundle
from kvdiag.scenario import load_scenario
from kvdiag.scenario.loader import parse_scenario
from kvdiag.scenario.models import EngineSpec, Scenario
from kvdiag.scenariorun import EngineWatch, Outcome
from kvdiag.watch.saturation import SaturationSampler
from kvdiag.watch.watchdog import MetricsPoller, NoProgressWatchdog

Clock = Callable[[], float]
COMMAND = "soak"
DEFAULT_SCENARIO = "soak-hybrid.yaml"
VLLM_SCENARIO = "soak-vllm.yaml"
_TICK_S = 0.25
_SAMPLE_S = 0.5          # the client's counters, for the report's plots
_MAX_SAMPLES = 4000
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class SoakOptions:
    """Everything `kvdiag soak` was asked to do."""

    model: str = "sim"
    url: str | None = None
    scenario: Path | None = None
    duration_s: float = 60.0
    concurrency: int = 32
    max_tokens: int = 256
    allocator: str | None = None
    stall_window_s: float | None = None      # None: the scenario's windows.stall_s
    chat: bool = False
    read_timeout_s: float = 60.0
    capture: bool = True
    metrics_period_s: float = 1.0
    tools: list[str] | None = None           # None: the scenario's capture.tools
    drain_grace_s: float = 5.0               # after --duration: requests in flight get this long to finish

    def validate(self) -> None:
        if self.duration_s <= 0:
            raise UsageError("--duration must be > 0")
        if not 1 <= self.concurrency <= 4096:
            raise UsageError("--concurrency must be within 1..4096")
        if self.max_tokens < 1:
            raise UsageError("--max-tokens must be >= 1")
        if not 0 <= self.drain_grace_s <= 600:
            raise UsageError("--drain-grace must be within 0..600 seconds")
        if self.stall_window_s is not None and self.stall_window_s <= 0:
            raise UsageError("--stall-window must be > 0")
        if self.read_timeout_s <= 0:
            raise UsageError("--read-timeout must be > 0")
        if self.read_timeout_s <= (self.stall_window_s or STALL_WINDOW_S):
            raise UsageError("--read-timeout must be longer than the stall window",
                             hint="requests that time out first would hide the stall from the watchdog")
        if self.url is not None:
            try:
                url_host_port(self.url)
            except ValueError:
                raise UsageError(f"--url {self.url!r} is not an http(s) URL",
                                 hint="for example --url http://127.0.0.1:8000") from None
            if self.scenario is not None:
                raise UsageError("--url and --scenario exclude each other",
                                 hint="--url loads a running server; --scenario launches one")
            if self.allocator is not None:
                raise UsageError("--allocator applies to engines kvdiag launches, not to --url",
                                 hint="restart your server with the allocator you want to test")
        elif self.model != "sim" and self.scenario is None and not _local_model_dir(self.model):
            raise UsageError(f"--model {self.model!r} is not a model folder on this machine; it needs --url (a "
                             "running server) or --scenario (how to launch it)",
                             hint="--model sim launches the simulated engine; --model DIR launches `vllm serve DIR`")


def _request_model(spec: EngineSpec) -> str | None:
    """The model name requests carry: none for the sim, what `vllm serve` was given for a vLLM engine."""
    if spec.kind == "sim":
        return None
    if spec.kind == "vllm":
        return expand(spec.model)
    return spec.model


def _local_model_dir(model: str) -> bool:
    """A Hugging Face style model folder here (config.json inside): `kvdiag soak --model DIR` serves it with vLLM."""
    return (Path(expand(model)) / "config.json").is_file()


def load_soak_scenario(path: Path | None, model: str = "sim") -> tuple[Scenario, str, str]:
    """The scenario file, or an embedded default: soak-hybrid (simulated) for ``model`` "sim", else
    soak-vllm serving the model folder ``model`` with real vLLM. Returns (scenario, name, text)."""
    if path is None:
        builtin = DEFAULT_SCENARIO if model == "sim" else VLLM_SCENARIO
        text = resources.files("kvdiag.scenario").joinpath("builtin", builtin).read_text("utf-8")
        name = f"<builtin>/{builtin}"
        scen = parse_scenario(text, name)
        if model != "sim":
            scen.engines[0].model = str(Path(expand(model)).resolve())
        return scen, name, text
    return load_scenario(path)


def single_engine(scenario: Scenario, allocator: str | None, stall_window_s: float | None) -> Scenario:
    """A copy of ``scenario`` with only its first engine (soak drives one engine). A ``serve`` phase stays: it
    is the engine's warm-up before the load (a first request answered, kernels compiled)."""
    first = scenario.engines[0].model_copy(deep=True)
    first.start_after = None
    if allocator is not None and (first.kind == "sim" or (first.kind == "vllm" and first.allocator != "external")):
        first.allocator = allocator  # type: ignore[assignment]
    windows = scenario.windows.model_copy()
    if stall_window_s is not None:
        windows.stall_s = stall_window_s
    return scenario.model_copy(update={"engines": [first], "windows": windows}, deep=True)


@dataclass
class _Subject:
    """The engine under load, launched or external."""

    name: str
    url: str
    allocator: str
    watch: EngineWatch | None = None          # launched engines only
    root_pid: int | None = None               # API server (process to capture from)
    log_pids: dict[str, int] = field(default_factory=dict)
    request_model: str | None = None


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
            return self._run_external(self.opts.url)
        return self._run_launched()

    # -- launched engine ---------------------------------------------------------------------------
    def _run_launched(self) -> RunArtifacts:
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
        spec = scen.engines[0]
        arts: RunArtifacts | None = None
        watch: EngineWatch | None = None
        try:
            with LaunchedRun(scen, text, self.bundle, self.bundle_dir, self._echo) as launched:
                run = launched.run
                self.t0 = run.t0
                try:
                    result = run.run()
                    launched.note_interpreters()
                    self.timeline.extend(run.timeline)
                    self.metrics.extend(result.metrics)
                    watch = result.watches[0] if result.watches else None
                    if watch is not None and watch.outcome is Outcome.READY:
                        subject = _Subject(name=spec.name, url=watch.plan.url, allocator=spec.allocator,
                                           watch=watch, root_pid=watch.proc.pid,
                                           request_model=_request_model(spec))
                        self._drive(subject)
                    elif watch is not None and watch.outcome is Outcome.STALLED and opts.capture:
                        # The engine never came up: capture its startup hang like `repro` does.
                        self._capture(_Subject(name=spec.name, url=watch.plan.url, allocator=spec.allocator,
                                               watch=watch, root_pid=watch.proc.pid,
                                               log_pids=dict(watch.state.pids)))
                except (Interrupted, KeyboardInterrupt) as exc:
                    self.interrupted = exc if isinstance(exc, Interrupted) else Interrupted("interrupted (Ctrl-C)")
                    self.timeline.extend(e for e in run.timeline if e not in self.timeline)
                self._fill_launched(watch)
                launched.copy_logs()
                if self.interrupted is None:
                    arts = self._verdict_and_report()
                    self._echo(f"verdict {arts.verdict.kind.value}; stopping the engine")
        except (Interrupted, KeyboardInterrupt) as exc:
            self.interrupted = self.interrupted or (
                exc if isinstance(exc, Interrupted) else Interrupted("interrupted (Ctrl-C)"))
        return self._final(arts)

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
    def _run_external(self, url: str) -> RunArtifacts:
        url = url.rstrip("/")
        host, port = url_host_port(url)
        name = "server"
        self.bundle.stall_window_s = self.window_s
        subject = _Subject(name=name, url=url, allocator="external")
        arts: RunArtifacts | None = None
        if not _answers(url):
            raise EngineFailed(f"no server answers at {url} (GET /health and /v1/models failed)",
                               hint="start the server first, or leave out --url to launch the simulated engine")
        self.event("server answers", url, engine=name)
        if self.opts.model != "sim":
            subject.request_model = self.opts.model
        else:
            subject.request_model = _served_model(url)
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
        try:
            # ProcessSet only for its signal handling and reaper: nothing is launched.
            with ProcessSet(grace_s=1.0):
                try:
                    self._drive(subject)
                except (Interrupted, KeyboardInterrupt) as exc:
                    self.interrupted = exc if isinstance(exc, Interrupted) else Interrupted("interrupted (Ctrl-C)")
                self._fill_external(subject)
                if self.interrupted is None:
                    arts = self._verdict_and_report()
        except (Interrupted, KeyboardInterrupt) as exc:
            self.interrupted = self.interrupted or (
                exc if isinstance(exc, Interrupted) else Interrupted("interrupted (Ctrl-C)"))
        return self._final(arts)

    def _fill_external(self, s: _Subject) -> None:
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
    def _drive(self, s: _Subject) -> None:
        """Run the load phase on a fresh event loop; signals become a clean stop."""
        saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
        try:
            asyncio.run(self._drive_async(s))
        finally:
            for sig, handler in saved.items():
                if handler is not None:
                    signal.signal(sig, handler)
        if self.interrupted is not None:
            raise self.interrupted

    async def _drive_async(self, s: _Subject) -> None:
        opts = self.opts
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            if self.interrupted is None:
                self.interrupted = Interrupted("interrupted (Ctrl-C)" if sig is signal.SIGINT
                                               else f"received {sig.name}")
            wake.set()

        for sig in _SIGNALS:
            try:
                loop.add_signal_handler(sig, on_signal, sig)
            except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
                pass
        cfg = LoadConfig(base_url=s.url, model=s.request_model, concurrency=opts.concurrency,
                         max_tokens=opts.max_tokens, chat=opts.chat, read_timeout_s=opts.read_timeout_s)
        lg = LoadGenerator(cfg, clock=self.clock)
        self.loadgen = lg
        poller = MetricsPoller(s.url, s.name, self.t0, clock=self.clock, period_s=opts.metrics_period_s)
        # A tick that comes late (this loop starved of CPU) is a gap in looking, not a stall.
        watchdog = NoProgressWatchdog(self.window_s, clock=self.clock, max_blind_s=4 * _TICK_S)
        view = ProgressView(self.console)
        sampler = SaturationSampler(opts.concurrency, _server_pids(s), clock=self.clock)
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
                    health_failures = 0 if await _healthy(health, s.url) else health_failures + 1
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
                r.healthy_after = await _healthy(health, s.url)
            elif r.exited:
                self.event("engine exited during the soak", engine=s.name)
            elif r.all_failing:
                self.event("every request failed", lg.first_error, engine=s.name)
            elif r.unreachable:
                self.event("server stopped answering", poller.last_error, engine=s.name)
            else:
                await lg.stop()   # cut what the drain left, before the probes below
                r.healthy_after = await _healthy(health, s.url)
                if self.interrupted is None:
                    await poller.poll_async()  # the gauges at the end
        finally:
            view.stop()
            await lg.stop()
            await poller.aclose()
            await health.aclose()
            self.metrics.extend(poller.snapshots)
            for sig in _SIGNALS:
                try:
                    loop.remove_signal_handler(sig)
                except (ValueError, RuntimeError, NotImplementedError):
                    pass
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

    def _engine_exited(self, s: _Subject) -> bool:
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
    def _capture(self, s: _Subject) -> None:
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

    def _verdict_and_report(self) -> RunArtifacts:
        """The run's tail: the soak's facts go into the bundle, analyze judges them (kvdiag.analyze)."""
        self._fill_common()
        return finish(self.out_dir, self.bundle, verdict_t=self.clock() - self.t0)

    def _final(self, arts: RunArtifacts | None) -> RunArtifacts:
        if self.interrupted is not None or arts is None:
            stop = self.interrupted or Interrupted("interrupted")
            if self.loadgen is not None and self.result.summary is None:
                self.result.summary = self.loadgen.summary()
            self._fill_common()
            self.bundle.interrupted = True
            self.bundle.interrupted_reason = stop.message
            finish(self.out_dir, self.bundle)
            self.console.print(f"interrupted; partial report written to {self.out_dir}")
            raise stop
        if self.result.all_failing:
            lg = self.loadgen
            raise KvdiagError(f"every request failed: {lg.first_error if lg else 'unknown error'}",
                              hint=f"report written to {self.out_dir}; check --model, --url and the server log")
        return arts

    def _echo(self, msg: str) -> None:
        self.console.print(f"[dim]{self.clock() - self.t0:6.1f}s[/dim] {escape(msg)}", highlight=False)


# -- small async helpers ---------------------------------------------------------------------------
async def _bounded(task: asyncio.Task[Any], timeout_s: float) -> None:
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout=timeout_s)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        task.cancel()
    except Exception:  # noqa: BLE001 - a poller bug must not hide the soak's result
        pass


async def _healthy(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(f"{url}/health")).status_code == 200
    except (httpx.HTTPError, OSError):
        return False


def _answers(url: str) -> bool:
    with httpx.Client(trust_env=False, timeout=httpx.Timeout(5.0)) as c:
        for path in ("/health", "/v1/models"):
            try:
                if c.get(f"{url}{path}").status_code == 200:
                    return True
            except (httpx.HTTPError, OSError):
                continue
    return False


def _served_model(url: str) -> str | None:
    """The first model id the server lists (what requests must name); None if it lists none."""
    try:
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(5.0)) as c:
            data = c.get(f"{url}/v1/models").json()
        first = data["data"][0]["id"]
        return str(first) if first else None
    except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _server_pids(s: _Subject) -> list[int]:
    """The server's processes whose CPU time the saturation judgement reads (API server and children)."""
    if s.root_pid is None:
        return []

    return process_tree(s.root_pid) or [s.root_pid]


def run_soak(opts: SoakOptions, out_dir: Path, console: Console) -> RunArtifacts:
    """Run `kvdiag soak` with ``opts`` and write the report into ``out_dir``."""
    return SoakRun(opts, out_dir, console).run()


__all__ = ["SoakOptions", "SoakRun", "load_soak_scenario", "run_soak", "single_engine"]
