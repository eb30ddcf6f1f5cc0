"""`kvdiag watch` as a run: the sentinel stage wired to discovery, capture, analysis and the reports.

The loop and the judgement live in :mod:`kvdiag.runs.watch.sentinel`; this module supplies what it is
injected with: the looks (HTTP + /proc), where each server's EngineCore is (the port's listener,
the EngineCore under it), the capture of a stall (the same path as ``kvdiag capture
--engine-core-of``: the EngineCore's tree, read-only, analyzed, a report folder), the events'
outputs (JSON lines, stderr, Prometheus), retention of report folders, and clean stops on
SIGTERM/SIGHUP. Nothing here signals or stops a watched process.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TextIO

import httpx

from kvdiag import interrupts
from kvdiag.capture.locate import locate, url_host_port
from kvdiag.capture.orchestrate import DEFAULT_BACKENDS, make_backends
from kvdiag.capture.select import capture_scope
from kvdiag.defaults import DEFAULT_PROBE_PERIOD_S, WATCH_WINDOW_S, Clock
from kvdiag.errors import UsageError
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import EnginePhase
from kvdiag.model.run import EngineRecord, TimelineEvent
from kvdiag.model.verdict import Verdict
from kvdiag.osread.stat import read_stat
from kvdiag.runs.capture import capture_run
from kvdiag.runs.fleet.ray import capture_cluster
from kvdiag.runs.output import finish
from kvdiag.runs.watch.canary import Canary, CanaryPolicy, ProbeSender
from kvdiag.runs.watch.events import ERROR, EventSink, WatchEvent
from kvdiag.runs.watch.exporter import WatchExporter
from kvdiag.runs.watch.local import LocalEngine
from kvdiag.runs.watch.looker import ServerLooker
from kvdiag.runs.watch.retention import capture_dir, prune
from kvdiag.runs.watch.sentinel import CaptureRequest, CaptureResult, EngineTracker, Sentinel, WatchOutcome
from kvdiag.watch.reading import Look


@dataclass
class WatchOptions:
    urls: list[str]
    pids: list[int] = field(default_factory=list)
    window_s: float = WATCH_WINDOW_S
    period_s: float = 1.0
    once: bool = False
    out: Path = Path("reports/watch")
    keep: int = 20
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    cooldown_s: float = 300.0
    duration_s: float | None = None
    tools: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))
    capture_timeout_s: float = 10.0
    ray: str | None = None           # capture a stall through the Ray fleet path (every node) instead
    verbose: bool = False            # a stderr line per look (else one per engine a minute)
    probe: bool = False              # a one-token canary to a server idle for probe_period_s
    probe_period_s: float = DEFAULT_PROBE_PERIOD_S

    def validate(self) -> None:
        """Usage errors before anything starts."""
        if not self.urls:
            raise UsageError("give at least one --url URL of a running server")
        clean: list[str] = []
        for url in self.urls:
            try:
                url_host_port(url)
            except ValueError as exc:
                raise UsageError(f"--url {url}: {exc}", hint="e.g. --url http://127.0.0.1:8000") from None
            clean.append(url.rstrip("/"))
        if len(set(clean)) != len(clean):
            raise UsageError("--url: the same server is named twice")
        self.urls = clean
        if self.pids and len(self.pids) != len(self.urls):
            raise UsageError(f"--pid given {len(self.pids)} time(s) for {len(self.urls)} --url: give one --pid per "
                             "--url, in the same order, or none (found from each URL's port)")
        for pid in self.pids:
            if pid <= 1 or read_stat(pid) is None:
                raise UsageError(f"--pid {pid}: no such process",
                                 hint="the API server (`vllm serve`) or its EngineCore")
        if not 0 < self.window_s <= 3600:
            raise UsageError(f"--window {self.window_s:g}: must be in (0, 3600] seconds")
        if not 0.1 <= self.period_s <= self.window_s:
            raise UsageError(f"--period {self.period_s:g}: must be between 0.1 s and the window")
        if self.probe and not self.period_s <= self.probe_period_s <= 86400:
            raise UsageError(f"--probe-period {self.probe_period_s:g}: must be between --period and a day")
        if self.keep < 1:
            raise UsageError(f"--keep {self.keep}: keep at least one report folder")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise UsageError(f"--metrics-port {self.metrics_port}: not a port")
        if self.duration_s is not None and self.duration_s <= 0:
            raise UsageError("--duration must be > 0")
        if self.cooldown_s < 0:
            raise UsageError("--cooldown must be >= 0")
        if not 0 < self.capture_timeout_s <= 600:
            raise UsageError(f"--capture-timeout {self.capture_timeout_s:g}: must be in (0, 600] seconds")
        try:
            make_backends(self.tools)
        except ValueError as exc:
            raise UsageError(f"--tools: {exc}") from None
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            # A fresh file of our own (never a same-named file someone keeps there), gone on close.
            with tempfile.NamedTemporaryFile(dir=self.out, prefix=".kvdiag-write-test-"):
                pass
        except OSError as exc:
            raise UsageError(f"cannot write output folder {self.out}: {exc.strerror or exc}",
                             hint="pass --out DIR pointing at a writable folder") from None


def engine_name(url: str) -> str:
    host, port = url_host_port(url)
    return f"{host}:{port}"


def _served_engine(bundle: Bundle, req: CaptureRequest) -> None:
    """The watched server as the engine it is: it served (/metrics answered) and then stalled, as a soak
    of the same server records it, so the analyzer judges a stall under load the same way (decode_stall
    when requests run with the KV pool full and no token comes, with the mechanism the stacks show)."""
    if len(bundle.engines) == 1:            # its log was found: that record, as the watch saw it end
        rec = bundle.engines[0]
        rec.phase = EnginePhase.STALLED
        old, rec.name = rec.name, req.engine   # the server as the user named it, not "pid-N"
        for p in bundle.processes:
            p.engine = req.engine if p.engine in (None, old) else p.engine
        for f in bundle.findings:
            f.engine = req.engine if f.engine == old else f.engine
        return
    if bundle.engines:
        return
    pids = {k: v for k, v in (("api_server", req.server_pid), ("engine_core", req.core_pid)) if v is not None}
    bundle.engines.append(EngineRecord(name=req.engine, allocator="external", phase=EnginePhase.STALLED,
                                       healthy=False, pids=pids))
    for p in bundle.processes:
        p.engine = p.engine or req.engine


def _add_watch_record(bundle: Bundle, req: CaptureRequest) -> None:
    """What the watch saw, in the bundle: the engine's metrics and when progress stopped."""
    bundle.stall_detected = True
    bundle.stall_window_s = req.window_s
    # The engine's metrics as the watch read them; one engine per bundle, so they name none.
    bundle.metrics = [s.model_copy(update={"engine": None}) for s in req.snapshots]
    _served_engine(bundle, req)
    bundle.timeline += [
        TimelineEvent(t=round(req.onset_t, 3), event="last progress", engine=req.engine,
                      detail="the last look at which tokens, prefill or finished requests grew"),
        TimelineEvent(t=round(req.detected_t, 3), event="stall detected", engine=req.engine,
                      detail=req.cause or f"requests in flight, no progress for {req.window_s:g}s"),
    ]


def capture_stall(req: CaptureRequest, announce: Callable[[CaptureResult], None], opts: WatchOptions, t0: float,
                  clock: Clock, human: Callable[[str], None] = lambda line: None) -> CaptureResult:
    """Capture the stalled EngineCore's tree read-only into a report folder under --out (as ``kvdiag capture
    --engine-core-of``; with --ray, every node of the cluster as ``kvdiag capture --ray``), with the watch's
    metrics and timeline in the bundle; ``announce`` the verdict as soon as the evidence is in; prune to --keep."""
    out_dir = capture_dir(opts.out, req.engine)
    bundle_dir = out_dir / "bundle"
    bundle_dir.mkdir(parents=True, exist_ok=True)
    command = f"watch --url {req.url}"
    def record(bundle: Bundle) -> None:
        _add_watch_record(bundle, req)

    if opts.ray is not None:
        bundle = capture_cluster(opts.ray, bundle_dir, timeout_s=opts.capture_timeout_s, backends=opts.tools,
                                 progress=human)
        bundle.command = f"{command} --ray {opts.ray}"
        record(bundle)
        arts = finish(out_dir, bundle, verdict_t=clock() - t0)
    else:
        if req.core_pid is None:
            raise UsageError(f"{req.engine}: no local EngineCore to capture")
        scope = capture_scope(req.core_pid)
        if scope.problems:
            raise UsageError(f"refusing to capture pid {req.core_pid}: " + "; ".join(scope.problems))
        arts = capture_run(req.core_pid, scope, out_dir, timeout_s=opts.capture_timeout_s, tools=opts.tools,
                           command=command, record=record, verdict_t=lambda: clock() - t0,
                           on_verdict=lambda d: announce(_result(d.verdict, d.exit_code, out_dir,
                                                                  _since_detection(req, clock() - t0))))
    prune(opts.out, opts.keep)
    return _result(arts.verdict, arts.exit_code, out_dir, arts.bundle.stall_to_verdict_s)


def _since_detection(req: CaptureRequest, now_t: float) -> float:
    """Seconds from the stall's detection to ``now_t`` (run clock): what the report records as
    stall_to_verdict_s, given with the early verdict too."""
    return round(max(0.0, now_t - req.detected_t), 3)


def _result(v: Verdict, exit_code: int, out_dir: Path, stall_to_verdict_s: float | None) -> CaptureResult:
    return CaptureResult(kind=v.kind.value, summary=v.summary, confidence=v.confidence.value, exit_code=exit_code,
                         out=str(out_dir), stall_to_verdict_s=stall_to_verdict_s)


def status_line(tr: EngineTracker, look: Look, took_s: float) -> str:
    """One stderr line about the last look at an engine."""
    m = look.metrics
    if m is None:
        return f"{tr.name}: no answer ({look.error}); look took {took_s:.2f}s"
    parts = [f"{tr.name}: in flight {m.in_flight if m.in_flight is not None else '-'}",
             f"progress {m.progress:.0f}" if m.progress is not None else "progress -",
             f"/health {look.health}"]
    if m.kv_cache_usage is not None:
        parts.append(f"KV {m.kv_cache_usage:.0%}")
    if m.in_flight:
        parts.append(f"quiet {tr.quiet_s:.1f}s")
    if look.core is not None:
        parts.append(f"EngineCore {look.core.pid} {look.core.state} {look.core.wchan or '-'} "
                     f"CPU {tr.cpu_pct if tr.cpu_pct is not None else '-'}%")
    parts.append(f"look {took_s:.2f}s")
    return ", ".join(parts)


class _StatusLines:
    """Every look with --verbose, else one line per engine every ``every_s``."""

    def __init__(self, human: Callable[[str], None], verbose: bool, clock: Clock,
                 every_s: float = 60.0) -> None:
        self.human, self.verbose, self.clock, self.every_s = human, verbose, clock, every_s
        self._last: dict[str, float] = {}

    def __call__(self, tr: EngineTracker, look: Look, took_s: float) -> None:
        now = self.clock()
        if self.verbose or now - self._last.get(tr.name, -1e9) >= self.every_s:
            self._last[tr.name] = now
            self.human(status_line(tr, look, took_s))


class _StopFlag:
    """SIGTERM and SIGHUP end the watch at its next wait (every wait is bounded), never mid-capture."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""

    def stop(self, reason: str) -> None:
        self.reason = reason
        self.event.set()


def run_watch(opts: WatchOptions, stdout: TextIO, human: Callable[[str], None],
              clock: Clock = time.monotonic) -> WatchOutcome:
    """Watch until stopped (SIGTERM/SIGHUP, --duration) or, with --once, until a stall is named."""
    flag = _StopFlag()
    sink = EventSink(stdout, human)
    t0 = clock()
    trackers: list[EngineTracker] = []
    lookers: dict[str, Callable[[], Look]] = {}
    canaries: dict[str, Canary] = {}
    start_fields: dict[str, dict[str, object]] = {}
    client = httpx.Client(trust_env=False, timeout=httpx.Timeout(2.0))
    exporter: WatchExporter | None = None
    try:
        for i, url in enumerate(opts.urls):
            name = engine_name(url)
            hint = opts.pids[i] if opts.pids else None
            local = LocalEngine(locate=partial(locate, url, hint), clock=clock)
            local.refresh(force=True)
            tr = EngineTracker(name, url, opts.window_s, period_s=opts.period_s, cooldown_s=opts.cooldown_s, t0=t0,
                               capture_remote=opts.ray is not None)
            trackers.append(tr)
            lookers[name] = ServerLooker(url, client, local, clock=clock)
            if opts.probe:
                canaries[name] = Canary(name, ProbeSender(url, opts.window_s, clock=clock),
                                        CanaryPolicy(period_s=opts.probe_period_s))
            start_fields[name] = {"local": local.note or "EngineCore found", "out": str(opts.out), "ray": opts.ray,
                                  "probe_period_s": opts.probe_period_s if opts.probe else None}
        if opts.metrics_port is not None:
            exporter = WatchExporter(trackers)
            port = exporter.serve(opts.metrics_port, opts.metrics_addr)
            sink.listeners.append(exporter.on_event)
            human(f"Prometheus metrics on http://{opts.metrics_addr}:{port}/metrics, readiness on /ready")
            for f in start_fields.values():
                f["metrics_port"] = port
        sentinel = Sentinel(trackers=trackers, lookers=lookers,
                            capture=lambda req, announce: capture_stall(req, announce, opts, t0, clock, human),
                            sink=sink, clock=clock,
                            wait=flag.event.wait, period_s=opts.period_s, once=opts.once,
                            duration_s=opts.duration_s, start_fields=start_fields, wall=time.time,
                            stop_reason=lambda: flag.reason, progress=_StatusLines(human, opts.verbose, clock),
                            probe=(lambda tr, look: canaries[tr.name].after_look(tr, look)) if canaries else None)
        with interrupts.on_stop(flag.stop, signals=interrupts.STOP_SIGNALS):
            outcome = sentinel.run()
        return outcome
    except OSError as exc:
        sink.emit(WatchEvent(ERROR, None, time.time(), {"kind": "startup", "error": str(exc)}))
        raise UsageError(str(exc)) from None
    finally:
        client.close()
        if exporter is not None:
            exporter.close()


__all__ = ["WatchOptions", "capture_stall", "engine_name", "run_watch"]
