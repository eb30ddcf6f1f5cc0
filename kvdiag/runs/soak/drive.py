"""A soak's load phase: the load stage's streaming clients under the serving no-progress watchdog, with
the /metrics poller and the saturation sampler of the watch stage beside them.

The phase runs on an event loop of its own until the stated duration and its drain are over, a stall is
declared, the engine exits, every request fails or an external server stops answering; a stall is
captured while its requests are still in flight. What it saw lands in a :class:`DriveResult` and in
the run's metrics and findings, which :class:`~kvdiag.runs.soak.session.SoakRun` writes into the bundle.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from rich.console import Console

from kvdiag import interrupts
from kvdiag.analyze.soak import flat_generation_span
from kvdiag.defaults import Clock
from kvdiag.errors import Interrupted
from kvdiag.load.loadgen import LoadGenerator
from kvdiag.load.progress import ProgressView
from kvdiag.load.request import LoadConfig
from kvdiag.load.stats import SoakSummary
from kvdiag.logs.lines import feed_line
from kvdiag.model.run import Finding, MetricsSnapshot
from kvdiag.model.soakseries import SoakSample
from kvdiag.runs.soak.options import SoakOptions
from kvdiag.runs.soak.subject import Subject, healthy, server_pids
from kvdiag.watch.poller import MetricsPoller
from kvdiag.watch.saturation import SaturationSampler
from kvdiag.watch.stall import ServingStall

_TICK_S = 0.25
_SAMPLE_S = 0.5          # the client's counters, for the report's plots
_MAX_SAMPLES = 4000


class EventSink(Protocol):
    """Where the phase notes a timeline event (the run's clock, echoed to the console unless ``echo`` is off)."""

    def __call__(self, event: str, detail: str | None = None, engine: str | None = None,
                 at: float | None = None, echo: bool = True) -> None: ...


@dataclass
class DriveResult:
    """What the load phase saw: how it ended, the client's summary and series, the scrapes and readings."""

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


@dataclass(eq=False)
class LoadPhase:
    """One soak's load phase (see the module). Create, then :meth:`drive` a subject."""

    opts: SoakOptions
    window_s: float                            # the no-progress window
    t0: float                                  # the run clock's origin
    clock: Clock
    console: Console
    event: EventSink
    capture: Callable[[Subject], None]         # a stall's capture, while its requests are in flight
    result: DriveResult
    metrics: list[MetricsSnapshot]             # the run's: the poller's snapshots are added
    findings: list[Finding]                    # the run's: failed requests, /metrics gone during a stall
    loadgen: LoadGenerator | None = None
    interrupted: Interrupted | None = None

    def drive(self, s: Subject) -> None:
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
        watchdog = ServingStall(self.window_s, clock=self.clock, max_blind_s=4 * _TICK_S)
        view = ProgressView(self.console)
        sampler = SaturationSampler(opts.concurrency, server_pids(s), clock=self.clock)
        r = self.result
        lg.start(opts.duration_s)   # no new request after the duration, however late this loop looks
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
                    await asyncio.to_thread(self.capture, s)
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
