"""Run a scenario's engines in order and watch them until each is ready, stalls, dies or times out."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import httpx

from kvdiag.defaults import Clock
from kvdiag.errors import EngineFailed, UsageError
from kvdiag.launch.engines import LaunchPlan, plan_engine
from kvdiag.launch.process import EngineProcess, ProcessSet
from kvdiag.launch.vllm import expand
from kvdiag.logs.lines import MAX_LINE, LogState, feed_line, root_error
from kvdiag.model.kinds import EnginePhase
from kvdiag.model.run import EngineRecord, MetricsSnapshot, TimelineEvent
from kvdiag.osread.net import listening_ports
from kvdiag.osread.ptable import process_tree
from kvdiag.ports import free_port, port_in_use
from kvdiag.scenario.models import EngineSpec, Scenario
from kvdiag.watch.logs import LogFollower
from kvdiag.watch.probe import (
    check_health,
    cpu_ticks,
    probe_completion,
    scrape_metrics,
    threads_blocked,
)
from kvdiag.watch.serving import RequestLoop
from kvdiag.watch.stall import Observation, ServingStall, StallDetector


class Outcome(str, Enum):
    PENDING = "pending"
    READY = "ready"
    STALLED = "stalled"
    EXITED = "exited"
    TIMEOUT = "timeout"
    NOT_STARTED = "not_started"


@dataclass
class EngineWatch:
    spec: EngineSpec
    plan: LaunchPlan
    proc: EngineProcess
    follower: LogFollower
    detector: StallDetector
    state: LogState = field(default_factory=LogState)
    outcome: Outcome = Outcome.PENDING
    healthy: bool = False
    started_t: float | None = None
    ready_t: float | None = None
    stalled_t: float | None = None       # when the detector declared the stall
    quiet_since_t: float | None = None   # last progress before the stall (stall onset)
    ready_re: re.Pattern[str] | None = None
    wrong_port_since: float | None = None   # says it serves, /health silent on its port, listens elsewhere

    def record(self, log_rel: str) -> EngineRecord:
        phase = self.state.phase
        if self.outcome is Outcome.STALLED:
            phase = EnginePhase.STALLED
        elif self.outcome is Outcome.EXITED:
            phase = EnginePhase.EXITED
        pids = dict(self.state.pids)
        if self.proc.pid is not None:
            pids.setdefault("api_server", self.proc.pid)
        return EngineRecord(
            name=self.spec.name, allocator=self.spec.allocator, phase=phase, url=self.plan.url,
            healthy=self.healthy, exit_code=self.proc.returncode(), log_path=log_rel,
            log_tail=list(self.state.tail)[-40:], last_log_line=self.state.last_line,
            banners=list(self.state.banners), pids=pids,
            startup_s=(self.ready_t - self.started_t) if self.ready_t and self.started_t else None,
            error=root_error(self.state.errors), kind=self.spec.kind,
        )


@dataclass
class RunResult:
    watches: list[EngineWatch]
    timeline: list[TimelineEvent]
    metrics: list[MetricsSnapshot]
    t0: float

    @property
    def stalled(self) -> list[EngineWatch]:
        return [w for w in self.watches if w.outcome is Outcome.STALLED]

    @property
    def failed(self) -> list[EngineWatch]:
        return [w for w in self.watches if w.outcome in (Outcome.EXITED, Outcome.TIMEOUT)]


Progress = Callable[[str, EngineWatch | None], None]


class ScenarioRun:
    """Starts engines in scenario order (each after the previous is ready) and watches all of them."""

    def __init__(self, scenario: Scenario, log_dir: Path, procs: ProcessSet, device_name: str,
                 progress: Progress | None = None, clock: Clock = time.monotonic) -> None:
        self.scenario = scenario
        self.log_dir = log_dir
        self.procs = procs
        self.device_name = device_name
        self.progress = progress or (lambda msg, w: None)
        self.clock = clock
        self.t0 = clock()
        self.timeline: list[TimelineEvent] = []
        self.metrics: list[MetricsSnapshot] = []
        self.watches: list[EngineWatch] = []
        self._client = httpx.Client(trust_env=False)

    def _event(self, event: str, engine: str | None = None, detail: str | None = None,
               at: float | None = None) -> None:
        t = self.clock() if at is None else at
        self.timeline.append(TimelineEvent(t=round(t - self.t0, 3), event=event, engine=engine, detail=detail))
        self.progress(f"{engine + ': ' if engine else ''}{event}{' (' + detail + ')' if detail else ''}",
                      None)

    def _prepare(self, spec: EngineSpec) -> EngineWatch:
        port = spec.port
        if port == 0:
            port = free_port(spec.host)
        elif port_in_use(spec.host, port):
            raise UsageError(f"engine {spec.name!r}: port {port} is already in use",
                             hint="stop what listens there or set port: 0 to pick a free one")
        plan = plan_engine(spec, port, self.device_name, self.scenario.device.size_gb, run_dir=self.procs.run_dir())
        log_path = self.log_dir / f"{spec.name}.log"
        proc = EngineProcess(spec.name, plan.argv, self.procs.env_for(plan.env), log_path, spec.cwd)
        ready_re = re.compile(spec.ready[4:]) if spec.ready.startswith("log:") else None
        return EngineWatch(spec=spec, plan=plan, proc=proc, follower=LogFollower(log_path),
                           detector=StallDetector(self.scenario.windows.stall_s), ready_re=ready_re)

    def _poll(self, w: EngineWatch, now: float) -> None:
        """One observation of one engine; updates its outcome."""
        new = w.follower.read_new()
        for line in new:
            for ev in feed_line(w.state, line, w.spec.name):
                # Stamped with the poll's time, the time the stall detector counts the line as progress:
                # a stall's onset (its last progress) then never precedes the line that was that progress.
                self._event(ev, w.spec.name, at=now)
            if w.ready_re is not None and w.ready_re.search(line) and w.outcome is Outcome.PENDING:
                w.healthy = True
        rc = w.proc.returncode()
        if rc is not None:
            if w.outcome in (Outcome.PENDING, Outcome.READY):
                w.outcome = Outcome.EXITED
                w.healthy = False
                self._event("engine exited", w.spec.name, f"exit code {rc}")
            return
        if w.ready_re is None:
            w.healthy = check_health(self._client, w.plan.url, timeout_s=min(1.0, self.scenario.windows.poll_s * 4))
        if w.outcome is Outcome.PENDING:
            if w.healthy:
                w.outcome = Outcome.READY
                w.ready_t = now
                self._event("ready", w.spec.name, f"{w.plan.url} after {now - (w.started_t or now):.1f}s")
                return
            pids = process_tree(w.proc.pid) if w.proc.pid else []
            self._check_port(w, now, pids)
            core = w.state.pids.get("engine_core")
            obs = Observation(now=now, new_log_lines=len(new), cpu_ticks=cpu_ticks(pids), healthy=False,
                              all_threads_blocked=threads_blocked(core) if core else None,
                              output_started=w.state.last_line is not None)
            if w.detector.observe(obs):
                w.outcome = Outcome.STALLED
                w.stalled_t = now
                w.quiet_since_t = w.detector.quiet_since
                self._event("stall detected", w.spec.name,
                            f"no log line, health or CPU progress for {self.scenario.windows.stall_s:g}s; "
                            f"last line: {(w.state.last_line or '')[:MAX_LINE]}")
            elif w.started_t is not None and now - w.started_t > self.scenario.windows.startup_timeout_s:
                w.outcome = Outcome.TIMEOUT
                self._event("startup timeout", w.spec.name,
                            f"not ready after {self.scenario.windows.startup_timeout_s:g}s but still progressing; "
                            f"{_readiness_text(w)}")

    def _check_port(self, w: EngineWatch, now: float, pids: list[int]) -> None:
        """An engine whose log says it serves while nothing answers on the port kvdiag gave it, and that
        listens elsewhere, ignored the port: fail at once, naming both (seen twice, a second apart)."""
        if w.ready_re is not None or w.state.phase is not EnginePhase.SERVING or not pids:
            w.wrong_port_since = None
            return
        other = [p for p in listening_ports(pids) if p != w.plan.port]
        if not other:
            w.wrong_port_since = None
            return
        if w.wrong_port_since is None:
            w.wrong_port_since = now
            return
        if now - w.wrong_port_since >= 1.0:
            raise EngineFailed(
                f"engine {w.spec.name!r} started but listens on port {', '.join(map(str, other))}, not on port "
                f"{w.plan.port} that kvdiag chose for it: nothing answers GET {w.plan.url}/health",
                hint="put the {port} placeholder in its command (e.g. --port {port}), or set a fixed port: "
                     "that the command also uses")

    def _probe_completion(self, w: EngineWatch) -> None:
        """A real engine that is up must also serve: one short completion, its answer on the timeline."""
        ok, detail = probe_completion(self._client, w.plan.url, expand(w.spec.model))
        self._event("completion answered" if ok else "completion failed", w.spec.name, detail)
        if not ok:
            w.healthy = False

    def _serve(self, deadline: float) -> None:
        """The serving phase (scenario ``serve``): requests to every ready engine until one stalls, fails,
        or ``serve.duration_s`` has passed since the last engine's warm-up answer."""
        serve = self.scenario.serve
        assert serve is not None
        windows = self.scenario.windows
        t0 = self.clock()
        loops: dict[str, RequestLoop] = {}
        stalls: dict[str, ServingStall] = {}
        warm: dict[str, float] = {}
        for w in self.watches:
            model = expand(w.spec.model) if w.spec.kind == "vllm" else w.spec.model
            loops[w.spec.name] = RequestLoop(w.plan.url, model, serve.max_tokens,
                                             timeout_s=windows.timeout_s)
            stalls[w.spec.name] = ServingStall(windows.stall_s, clock=self.clock)
        self._event("serving", detail=f"{len(loops)} engine(s), one request at a time, {serve.duration_s:g}s "
                    "after the warm-up answer")
        for loop in loops.values():
            loop.start()
        try:
            while True:
                now = self.clock()
                if now > deadline:
                    self._event("run timeout", None, f"after {windows.timeout_s:g}s")
                    return
                for w in self.watches:
                    if w.outcome is not Outcome.READY:
                        continue
                    self._poll(w, now)
                    if w.outcome is not Outcome.READY:
                        continue
                    counts = loops[w.spec.name].counts()
                    if counts.first_answer_t is None:
                        if now - t0 > windows.startup_timeout_s:
                            w.outcome = Outcome.TIMEOUT
                            self._event("startup timeout", w.spec.name,
                                        f"the first request was not answered after {windows.startup_timeout_s:g}s"
                                        + (f" ({counts.last_error})" if counts.last_error else ""))
                        continue
                    if w.spec.name not in warm:
                        warm[w.spec.name] = counts.first_answer_t
                        self._event("first request answered", w.spec.name,
                                    f"{counts.tokens} tokens after {counts.first_answer_t - t0:.1f}s (warm-up)")
                    if stalls[w.spec.name].observe(counts.in_flight, counts.progress, counts.last_answer_t,
                                                   now=now):
                        w.outcome = Outcome.STALLED
                        w.stalled_t = now
                        w.quiet_since_t = stalls[w.spec.name].onset
                        self._event("stall detected", w.spec.name,
                                    f"a request in flight and nothing answered for {windows.stall_s:g}s while "
                                    f"serving ({counts.answered} answered before it)")
                if any(w.outcome is not Outcome.READY for w in self.watches):
                    return
                if len(warm) == len(loops) and now - max(warm.values()) >= serve.duration_s:
                    answered = sum(c.answered for c in (lp.counts() for lp in loops.values()))
                    self._event("served", None, f"{answered} request(s) answered, none stalled")
                    return
                time.sleep(windows.poll_s)
        finally:
            for loop in loops.values():
                loop.stop()

    def run(self) -> RunResult:
        windows = self.scenario.windows
        deadline = self.t0 + windows.timeout_s
        try:
            for spec in self.scenario.ordered_engines():
                w = self._prepare(spec)
                self.watches.append(w)
                self.procs.start(w.proc)
                w.started_t = self.clock()
                self._event("launched", spec.name, f"pid {w.proc.pid} on {w.plan.url}")
                while w.outcome is Outcome.PENDING:
                    now = self.clock()
                    if now > deadline:
                        w.outcome = Outcome.TIMEOUT
                        self._event("run timeout", spec.name, f"after {windows.timeout_s:g}s")
                        break
                    for other in self.watches:
                        self._poll(other, now)
                    if w.outcome is Outcome.PENDING:
                        time.sleep(windows.poll_s)
                if w.outcome is not Outcome.READY:
                    break  # later engines depend on this one being up
            if self.scenario.serve is not None and self.watches and all(
                    w.outcome is Outcome.READY for w in self.watches):
                self._serve(deadline)
            # Final look at every engine so "engine 1 stays healthy" is checked after the stall.
            now = self.clock()
            for w in self.watches:
                if w.outcome is Outcome.READY:
                    w.healthy = check_health(self._client, w.plan.url)
                    snap = scrape_metrics(self._client, w.plan.url, round(now - self.t0, 3), w.spec.name)
                    if snap is not None:
                        self.metrics.append(snap)
                    if w.spec.kind == "vllm" and w.healthy:
                        self._probe_completion(w)
                else:
                    self._poll(w, now)
        finally:
            self._client.close()
        for spec in self.scenario.ordered_engines():
            if not any(w.spec.name == spec.name for w in self.watches):
                self._event("not started", spec.name, "an earlier engine did not become ready")
        return RunResult(self.watches, self.timeline, self.metrics, self.t0)


def _readiness_text(w: EngineWatch) -> str:
    if w.ready_re is not None:
        return f"its log never matched {w.spec.ready[4:]!r}"
    return (f"nothing answered GET {w.plan.url}/health on port {w.plan.port} (the port kvdiag gave it: does its "
            "command use {port}?)")
