"""The sentinel beside running servers: judge each look, name a stall once, keep watching.

:class:`EngineTracker` is pure logic over :class:`~kvdiag.watch.reading.Look` readings (the time
is in each look): a stall is requests running or waiting and no progress (tokens, prefill,
finished requests) for the window, whatever /health says; nothing in flight is idle; a server
whose counters go back, whose start time or whose pids change has restarted (an event; the stall
clock starts over). :class:`Sentinel` is the loop: it looks at every server each period, emits
the tracker's events, and hands a stall to the injected capture once (then a cooldown), or ends
with ``once``. Looking, capturing, waiting and the clock are all injected.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdiag.defaults import Clock
from kvdiag.errors import ExitCode
from kvdiag.model.run import MetricsSnapshot
from kvdiag.runs.watch.events import (
    ERROR,
    RECOVERED,
    REPORT,
    RESTART,
    STALL,
    START,
    STOP,
    VERDICT,
    EventSink,
    WatchEvent,
)
from kvdiag.watch.reading import CoreSample, Look
from kvdiag.watch.stall import ServingStall

# A start time that moved by more than this is another process (the exposition rounds it).
_START_TIME_SLACK_S = 1.0


@dataclass
class EngineTracker:
    """The judgement of one server over successive looks (pure: the time is in each look)."""

    name: str
    url: str
    window_s: float
    period_s: float = 1.0
    cooldown_s: float = 300.0
    t0: float = 0.0                     # run clock origin, for the snapshots' times
    history: int = 120                  # snapshots kept for the bundle
    capture_remote: bool = False        # stalls are captured elsewhere (the Ray fleet path): no local EngineCore needed
    reachable: bool | None = None
    ever_reached: bool = False       # one look answered (/metrics read) during the watch
    unreachable_since: float | None = None
    in_stall: bool = False
    stall_onset: float | None = None
    last_capture_t: float | None = None
    stalls: int = 0
    restarts: int = 0
    scrape_errors: int = 0
    last_look: Look | None = None
    cpu_pct: float | None = None        # EngineCore CPU over the last period, % of one core
    snapshots: deque[MetricsSnapshot] = field(default_factory=deque)
    _stall: ServingStall | None = None
    _server_pid: int | None = None
    _core_pid: int | None = None
    _start_time: float | None = None
    _progress: float | None = None
    _cpu_prev: tuple[float, int, int] | None = None   # (t, pid, ticks)
    _gaps: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    _probe_stall_progress: float | None = None   # progress when a probe went unanswered (a stall while idle)
    _probe_stall: bool = False

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        self._stall = self._new_stall()

    def _new_stall(self) -> ServingStall:
        return ServingStall(self.window_s, clock=self._now, max_blind_s=self._blind_after())

    def _blind_after(self) -> float:
        """A look that comes this long after the previous one (the loop was capturing another engine, or
        starved of CPU) is not evidence: it never fires. Relative to how long looks usually take here, so a
        server whose /metrics is always slow is still judged."""
        usual = sorted(self._gaps)[(len(self._gaps) - 1) // 2] if self._gaps else 0.0
        return max(3.0 * self.period_s, 2.0, 3.0 * usual)

    def _now(self) -> float:
        return self.last_look.t if self.last_look is not None else 0.0

    @property
    def quiet_s(self) -> float:
        """Seconds since the last progress (0 while idle)."""
        return self._stall.quiet_for if self._stall is not None else 0.0

    def observe(self, look: Look) -> list[WatchEvent]:
        """Feed one look; returns the events it makes (none most of the time)."""
        events: list[WatchEvent] = []
        prev = self.last_look
        if prev is not None and look.t > prev.t:
            self._gaps.append(look.t - prev.t)
        self.last_look = look
        self._note_cpu(look)
        if look.metrics is None:
            self.scrape_errors += 1
            if self.reachable is not False:
                self.unreachable_since = look.t
                events.append(self._event(ERROR, look, kind="unreachable" if look.health is None else "scrape",
                                          error=look.error or "no /metrics", health=look.health))
            self.reachable = False
            return events
        m = look.metrics
        reasons = self._restart_reasons(look)
        if reasons and prev is not None:
            self.restarts += 1
            self._stall = self._new_stall()
            self.in_stall = False
            self.stall_onset = None
            self._cpu_prev = None
            self._probe_stall = False
            events.append(self._event(RESTART, look, reasons=reasons, server_pid=look.server_pid,
                                      engine_core_pid=look.core.pid if look.core else None,
                                      down_s=None if self.unreachable_since is None
                                      else round(look.t - self.unreachable_since, 1)))
        elif self.reachable is False:
            events.append(self._event(RECOVERED, look, what="unreachable",
                                      after_s=round(look.t - (self.unreachable_since or look.t), 1)))
        self.reachable = True
        self.ever_reached = True
        self.unreachable_since = None
        self._remember(look)
        self.snapshots.append(m.snapshot(look.t - self.t0, self.name))
        while len(self.snapshots) > self.history:
            self.snapshots.popleft()
        assert self._stall is not None
        self._stall.max_blind_s = self._blind_after()
        in_flight = m.in_flight or 0
        stalled = self._stall.observe(in_flight, m.progress, now=look.t)
        if self._probe_stall:
            # Declared by an unanswered probe while idle: it ends at progress (or a restart, an answered probe).
            if m.progress is not None and self._probe_stall_progress is not None \
                    and m.progress > self._probe_stall_progress:
                self._probe_stall = False
            else:
                stalled = True
        if stalled and not self.in_stall:
            self.in_stall = True
            self.stalls += 1
            self.stall_onset = self._stall.onset
            events.append(self._stall_event(look))
        elif not stalled and self.in_stall:
            self.in_stall = False
            onset, self.stall_onset = self.stall_onset, None
            events.append(self._event(RECOVERED, look, what="stall",
                                      after_s=round(look.t - (onset if onset is not None else look.t), 1)))
        return events

    def note_capture(self, t: float) -> None:
        self.last_capture_t = t

    def probe_unanswered(self, look: Look, probe: dict[str, Any], sent_t: float) -> list[WatchEvent]:
        """A probe sent at ``sent_t`` got no answer within the window: a stall (unless one is on already)."""
        if self.in_stall or look.metrics is None:
            return []
        self._probe_stall = True
        self._probe_stall_progress = look.metrics.progress
        self.in_stall = True
        self.stalls += 1
        self.stall_onset = sent_t
        return [self._stall_event(look, probe=probe)]

    def probe_answered(self, look: Look) -> list[WatchEvent]:
        """The engine answered a probe: a stall an unanswered probe declared is over."""
        if not self._probe_stall:
            return []
        self._probe_stall = False
        if not self.in_stall:
            return []
        self.in_stall = False
        onset, self.stall_onset = self.stall_onset, None
        return [self._event(RECOVERED, look, what="stall", after_s=round(look.t - (onset or look.t), 1))]

    @property
    def ready(self) -> tuple[bool, str]:
        """Readiness from progress: (ready, why). Not ready while stalled or while /metrics does not answer."""
        if self.last_look is None:
            return False, "not looked at yet"
        if self.reachable is False:
            return False, "its /metrics does not answer"
        if self.in_stall:
            return False, (f"stalled: a probe got no answer within {self.window_s:g}s" if self._probe_stall
                           else f"stalled: requests in flight and no progress for {self.quiet_s:.0f}s")
        return True, "progressing or idle"

    # -- internals ---------------------------------------------------------------------------------
    def _restart_reasons(self, look: Look) -> list[str]:
        m = look.metrics
        assert m is not None
        out: list[str] = []
        if m.start_time is not None and self._start_time is not None \
                and abs(m.start_time - self._start_time) > _START_TIME_SLACK_S:
            out.append("the server's process_start_time_seconds changed")
        progress = m.progress
        if progress is not None and self._progress is not None and progress < self._progress:
            out.append(f"its counters went back ({self._progress:.0f} -> {progress:.0f})")
        if look.server_pid is not None and self._server_pid is not None and look.server_pid != self._server_pid:
            out.append(f"API server pid {self._server_pid} -> {look.server_pid}")
        core = look.core.pid if look.core is not None else None
        if core is not None and self._core_pid is not None and core != self._core_pid:
            out.append(f"EngineCore pid {self._core_pid} -> {core}")
        return out

    def _remember(self, look: Look) -> None:
        m = look.metrics
        assert m is not None
        if m.start_time is not None:
            self._start_time = m.start_time
        if m.progress is not None:
            self._progress = m.progress
        if look.server_pid is not None:
            self._server_pid = look.server_pid
        if look.core is not None:
            self._core_pid = look.core.pid

    def _note_cpu(self, look: Look) -> None:
        core = look.core
        if core is None:
            return
        if self._cpu_prev is not None and self._cpu_prev[1] == core.pid and look.t > self._cpu_prev[0]:
            self.cpu_pct = round(100.0 * (core.cpu_ticks - self._cpu_prev[2]) / _ticks_per_s()
                                 / (look.t - self._cpu_prev[0]), 1)
        self._cpu_prev = (look.t, core.pid, core.cpu_ticks)

    def _stall_event(self, look: Look, probe: dict[str, Any] | None = None) -> WatchEvent:
        m = look.metrics
        assert m is not None and self.stall_onset is not None
        quiet = round(look.t - self.stall_onset, 2)
        capture, why_not = True, None
        if look.core is None and not self.capture_remote:
            capture, why_not = False, "no local EngineCore (run kvdiag watch on the engine's host or pod, or --pid)"
        elif self.last_capture_t is not None and look.t - self.last_capture_t < self.cooldown_s:
            capture = False
            why_not = (f"cooldown: captured {look.t - self.last_capture_t:.0f}s ago "
                       f"(every {self.cooldown_s:g}s at most)")
        return self._event(STALL, look, in_flight=m.in_flight, running=m.running, waiting=m.waiting,
                           kv_cache_usage=m.kv_cache_usage, quiet_s=quiet, window_s=self.window_s,
                           onset_unix=round(look.wall - quiet, 3), health=look.health,
                           engine_core=_core_fields(look.core, self.cpu_pct), capture=capture, why_not=why_not,
                           probe=probe, api_in_progress=m.api_in_progress)

    def _event(self, name: str, look: Look, **fields: Any) -> WatchEvent:
        return WatchEvent(name, self.name, look.wall, {k: v for k, v in fields.items() if v is not None})


def _cause(ev: WatchEvent, window_s: float) -> str:
    probe = ev.fields.get("probe")
    if isinstance(probe, dict):
        return f"the engine was idle; probe {probe.get('id')} got no answer within {window_s:g}s"
    return ""


def _core_fields(core: CoreSample | None, cpu_pct: float | None) -> dict[str, Any] | None:
    if core is None:
        return None
    return {"pid": core.pid, "state": core.state, "wchan": core.wchan, "cpu_pct": cpu_pct}


def _ticks_per_s() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK")) or 100
    except (OSError, ValueError):
        return 100


@dataclass(frozen=True)
class CaptureRequest:
    """What a capture of a stalled engine needs to know."""

    engine: str
    url: str
    core_pid: int | None         # None: captured through the fleet path
    server_pid: int | None
    window_s: float
    onset_t: float          # run clock (seconds since the watch started)
    detected_t: float
    onset_wall: float
    snapshots: tuple[MetricsSnapshot, ...]
    cause: str = ""         # how the stall showed (default: requests in flight and no progress for the window)


@dataclass(frozen=True)
class CaptureResult:
    """The verdict a capture wrote (its report folder and exit code)."""

    kind: str
    summary: str
    confidence: str
    exit_code: int
    out: str
    stall_to_verdict_s: float | None = None


@dataclass
class WatchOutcome:
    stalls: int = 0
    named: int = 0
    stopped_by: str = ""
    once_hit: bool = False
    never_reached: list[str] = field(default_factory=list)   # servers that never answered: nothing judged

    @property
    def exit_code(self) -> int:
        """10 a stall named with --once; 5 a server never answered (nothing was judged); else 0."""
        if self.once_hit:
            return ExitCode.DEADLOCK
        return ExitCode.NOT_DIAGNOSABLE if self.never_reached else ExitCode.OK

    def closing_lines(self) -> list[str]:
        """What the watch says on stderr when it stops."""
        lines = [f"stopped ({self.stopped_by}): {self.stalls} stall(s), {self.named} named"]
        if not self.once_hit and self.never_reached:
            lines.append(f"nothing judged: {', '.join(self.never_reached)} never answered /metrics during the "
                         "watch (exit 5)")
        return lines


@dataclass
class Sentinel:
    """The watch loop over ``trackers``; ``lookers[name]()`` takes one look at that server."""

    trackers: list[EngineTracker]
    lookers: dict[str, Callable[[], Look]]
    # capture(request, announce): announce(result) as soon as the verdict is known (optional), return it
    capture: Callable[[CaptureRequest, Callable[[CaptureResult], None]], CaptureResult]
    sink: EventSink
    clock: Clock
    wait: Callable[[float], bool]           # sleeps up to S seconds; True when asked to stop
    period_s: float = 1.0
    once: bool = False
    duration_s: float | None = None         # stop after this long (None: until asked)
    start_fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    wall: Clock | None = None
    stop_reason: Callable[[], str] | None = None   # why ``wait`` said stop (a signal's name)
    progress: Callable[[EngineTracker, Look, float], None] | None = None   # each look, and how long it took
    # after each look: the canary's events (probes sent and ended, a stall an unanswered probe declared)
    probe: Callable[[EngineTracker, Look], list[WatchEvent]] | None = None

    def run(self) -> WatchOutcome:
        out = WatchOutcome()
        t_start = self.clock()
        first = True
        while True:
            tick = self.clock()
            for tr in self.trackers:
                before = self.clock()
                look = self._look(tr)
                if self.progress is not None:
                    self.progress(tr, look, self.clock() - before)
                if first:
                    self.sink.emit(WatchEvent(START, tr.name, look.wall, {
                        "url": tr.url, "window_s": tr.window_s, "period_s": self.period_s, "once": self.once,
                        "server_pid": look.server_pid, "engine_core_pid": look.core.pid if look.core else None,
                        **self.start_fields.get(tr.name, {})}))
                events = tr.observe(look)
                if self.probe is not None:
                    events += self.probe(tr, look)
                for ev in events:
                    self.sink.emit(ev)
                    if ev.event == STALL:
                        out.stalls += 1
                        self._on_stall(tr, ev, look, out)
                        if self.once:
                            out.once_hit = True
                            out.stopped_by = "stall named (--once)"
                            self._stop(out)
                            return out
            first = False
            now = self.clock()
            if self.duration_s is not None and now - t_start >= self.duration_s:
                out.stopped_by = f"--duration {self.duration_s:g}s"
                break
            if self.wait(max(0.0, self.period_s - (now - tick))):
                out.stopped_by = (self.stop_reason() if self.stop_reason is not None else "") or "asked to stop"
                break
        self._stop(out)
        return out

    def _look(self, tr: EngineTracker) -> Look:
        try:
            return self.lookers[tr.name]()
        except Exception as exc:  # noqa: BLE001 - a failed look is a scrape error, never the end of the watch
            wall = self.wall() if self.wall is not None else 0.0
            return Look(t=self.clock(), wall=wall, metrics=None, error=f"{type(exc).__name__}: {exc}"[:200])

    def _on_stall(self, tr: EngineTracker, ev: WatchEvent, look: Look, out: WatchOutcome) -> None:
        if not ev.fields.get("capture"):
            return
        tr.note_capture(look.t)
        onset = tr.stall_onset if tr.stall_onset is not None else look.t
        req = CaptureRequest(engine=tr.name, url=tr.url, core_pid=look.core.pid if look.core else None,
                             server_pid=look.server_pid, window_s=tr.window_s, onset_t=onset - tr.t0,
                             detected_t=look.t - tr.t0,
                             onset_wall=look.wall - (look.t - onset), snapshots=tuple(tr.snapshots),
                             cause=_cause(ev, tr.window_s))
        said: list[CaptureResult] = []

        def announce(res: CaptureResult) -> None:
            # The verdict as soon as the evidence names it; the report folder is being written.
            if not said:
                said.append(res)
                self._verdict(tr, req, res)

        try:
            res = self.capture(req, announce)
        except Exception as exc:  # noqa: BLE001 - a failed capture is an event; the watch goes on
            self.sink.emit(WatchEvent(ERROR, tr.name, self._wall_now(look), {
                "kind": "capture", "error": f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"[:300]}))
            return
        out.named += 1
        if not said:
            self._verdict(tr, req, res)
        self.sink.emit(WatchEvent(REPORT, tr.name, self._wall_now(look), {
            "kind": res.kind, "out": res.out, "stall_to_verdict_s": res.stall_to_verdict_s}))

    def _verdict(self, tr: EngineTracker, req: CaptureRequest, res: CaptureResult) -> None:
        wall = self.wall() if self.wall is not None else req.onset_wall
        self.sink.emit(WatchEvent(VERDICT, tr.name, wall, {
            "kind": res.kind, "summary": res.summary, "confidence": res.confidence, "exit_code": res.exit_code,
            "out": res.out, "stall_to_verdict_s": res.stall_to_verdict_s,
            "onset_to_verdict_s": round(wall - req.onset_wall, 2)}))

    def _wall_now(self, look: Look) -> float:
        return self.wall() if self.wall is not None else look.wall

    def _stop(self, out: WatchOutcome) -> None:
        wall = self.wall() if self.wall is not None else 0.0
        out.never_reached = [tr.name for tr in self.trackers if not tr.ever_reached]
        self.sink.emit(WatchEvent(STOP, None, wall, {"reason": out.stopped_by, "stalls": out.stalls,
                                                     "named": out.named, "never_reached": out.never_reached}))


__all__ = ["CaptureRequest", "CaptureResult", "EngineTracker", "Sentinel", "WatchOutcome"]
