"""The watch's canary: one bounded one-token request to a server that has been idle.

A frozen EngineCore publishes nothing, so vLLM's gauges keep the values of its last step; one that
froze while idle reads 0 running / 0 waiting, which looks like idleness. The canary asks such a
server for one token: an answer within the window says the engine still steps; none says it is
frozen, and the tracker declares a stall that is captured like any other.

:class:`CanaryPolicy` is pure (the time is passed in): when a probe is due (no progress and nothing
in flight for a probe period, at most one in flight, at most one per probe period) and what its
outcome means. :class:`Canary` sends the request from a daemon thread (bounded by the window) and
hands its outcome to the watch loop at the next look. A probe is marked so it can be told from user
traffic: the request's ``user`` field and its ``X-Request-Id`` header are ``kvdiag-probe-<n>``, its
User-Agent is ``kvdiag-watch-probe``, its prompt is fixed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvdiag.defaults import DEFAULT_PROBE_PERIOD_S, Clock
from kvdiag.runs.watch.events import PROBE, PROBE_ANSWERED, PROBE_FAILED, WatchEvent
from kvdiag.runs.watch.sentinel import EngineTracker
from kvdiag.watch.reading import Look

PROMPT = "kvdiag readiness probe"
USER_AGENT = "kvdiag-watch-probe"


def probe_id(n: int) -> str:
    return f"kvdiag-probe-{n}"


@dataclass(frozen=True)
class ProbeOutcome:
    """How one probe ended. ``answered``: the first token came within the window. ``timed_out``: no
    answer within the window (a frozen engine); any other failure (refused, HTTP error) is not a stall."""

    n: int
    sent_t: float
    sent_wall: float
    answered: bool
    latency_s: float
    timed_out: bool = False
    error: str | None = None
    status: int | None = None


@dataclass
class CanaryPolicy:
    """When the next probe is due for one server (pure: the time is in each call)."""

    period_s: float = DEFAULT_PROBE_PERIOD_S
    quiet_since: float | None = None        # last progress or work seen, or the last probe's end
    last_sent: float | None = None
    in_flight: bool = False
    _progress: float | None = None

    def note_look(self, look: Look) -> None:
        """Progress or work resets the quiet clock: a busy server needs no canary."""
        m = look.metrics
        if m is None:
            return
        busy = bool(m.in_flight) or bool(m.api_in_progress)
        grew = m.progress is not None and self._progress is not None and m.progress != self._progress
        if m.progress is not None:
            self._progress = m.progress
        if self.quiet_since is None or busy or grew:
            self.quiet_since = look.t

    def due(self, now: float, reachable: bool) -> bool:
        if self.in_flight or not reachable or self.quiet_since is None:
            return False
        if now - self.quiet_since < self.period_s:
            return False
        return self.last_sent is None or now - self.last_sent >= self.period_s

    def sent(self, now: float) -> None:
        self.in_flight = True
        self.last_sent = now

    def ended(self, now: float) -> None:
        self.in_flight = False
        self.quiet_since = now


@dataclass
class ProbeSender:
    """One bounded ``POST /v1/completions`` for one token; its first token within ``window_s`` is an answer."""

    url: str
    window_s: float
    clock: Clock = time.monotonic
    wall: Clock = time.time
    model: str | None = None
    transport: httpx.BaseTransport | None = None

    def __call__(self, n: int) -> ProbeOutcome:
        sent_t, sent_wall = self.clock(), self.wall()
        rid = probe_id(n)
        # Its own client: the probe runs beside the looks, and closing it aborts the request on a timeout.
        timeout = httpx.Timeout(self.window_s, connect=min(2.0, self.window_s))
        with httpx.Client(trust_env=False, timeout=timeout, transport=self.transport,
                          headers={"User-Agent": USER_AGENT, "X-Request-Id": rid}) as client:
            try:
                if self.model is None:
                    self.model = _served_model(client, self.url)
                body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0.0, "user": rid,
                                        "stream": False}
                if self.model:
                    body["model"] = self.model
                left = self.window_s - (self.clock() - sent_t)
                if left <= 0:
                    raise httpx.ReadTimeout("no time left in the window")
                resp = client.post(f"{self.url}/v1/completions", json=body,
                                   timeout=httpx.Timeout(left, connect=min(2.0, left)))
            except httpx.TimeoutException as exc:
                took = self.clock() - sent_t
                return ProbeOutcome(n, sent_t, sent_wall, False, round(took, 3), timed_out=True,
                                    error=f"no answer within {self.window_s:g}s ({type(exc).__name__})")
            except (httpx.HTTPError, OSError) as exc:
                took = self.clock() - sent_t
                return ProbeOutcome(n, sent_t, sent_wall, False, round(took, 3),
                                    error=f"{type(exc).__name__}: {exc}"[:200])
        took = self.clock() - sent_t
        if resp.status_code != 200:
            return ProbeOutcome(n, sent_t, sent_wall, False, round(took, 3), status=resp.status_code,
                                error=f"HTTP {resp.status_code}: {resp.text[:160]}")
        return ProbeOutcome(n, sent_t, sent_wall, took <= self.window_s, round(took, 3), status=200,
                            timed_out=took > self.window_s,
                            error=None if took <= self.window_s else f"answered after {took:.1f}s, past the window")


def _served_model(client: httpx.Client, url: str) -> str:
    """The first model /v1/models lists ('' when it lists none: the request then names none)."""
    try:
        data = client.get(f"{url}/v1/models", timeout=2.0).json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError, TypeError):
        return ""


@dataclass
class Canary:
    """The probes of one server: :meth:`step` after each look starts a due probe on a daemon thread and
    returns the events of the one that ended since (sent, answered, failed)."""

    engine: str
    send: Callable[[int], ProbeOutcome]
    policy: CanaryPolicy = field(default_factory=CanaryPolicy)
    sent: int = 0
    answered: int = 0
    failed: int = 0
    last_latency_s: float | None = None
    _done: list[ProbeOutcome] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def step(self, look: Look, reachable: bool) -> tuple[list[WatchEvent], ProbeOutcome | None]:
        """Events for this look, and the outcome of a probe that ended since the last one (if any)."""
        events: list[WatchEvent] = []
        with self._lock:
            done = self._done.pop() if self._done else None
        if done is not None:
            self.policy.ended(look.t)
            if done.answered:
                self.answered += 1
                self.last_latency_s = done.latency_s
                events.append(WatchEvent(PROBE_ANSWERED, self.engine, look.wall, {
                    "id": probe_id(done.n), "latency_s": done.latency_s}))
            else:
                self.failed += 1
                events.append(WatchEvent(PROBE_FAILED, self.engine, look.wall, {
                    "id": probe_id(done.n), "after_s": done.latency_s, "timed_out": done.timed_out,
                    "status": done.status, "error": done.error}))
        self.policy.note_look(look)
        if self.policy.due(look.t, reachable):
            self.sent += 1
            n = self.sent
            self.policy.sent(look.t)
            self._thread = threading.Thread(target=self._run, args=(n,), name=f"kvdiag-probe-{self.engine}",
                                            daemon=True)
            self._thread.start()
            events.append(WatchEvent(PROBE, self.engine, look.wall, {"id": probe_id(n)}))
        return events, done

    def after_look(self, tr: EngineTracker, look: Look) -> list[WatchEvent]:
        """The sentinel's hook: this look's probe events, and the tracker's verdict on a probe that ended
        (unanswered within the window: a stall; answered: such a stall is over)."""
        events, done = self.step(look, bool(tr.reachable))
        if done is not None and done.answered:
            events += tr.probe_answered(look)
        elif done is not None and done.timed_out:
            events += tr.probe_unanswered(look, {"id": probe_id(done.n), "sent_unix": round(done.sent_wall, 3),
                                                 "after_s": done.latency_s}, done.sent_t)
        return events

    def _run(self, n: int) -> None:
        try:
            out = self.send(n)
        except Exception as exc:  # noqa: BLE001 - a probe that broke is a failed probe, never the end of the watch
            out = ProbeOutcome(n, 0.0, 0.0, False, 0.0, error=f"{type(exc).__name__}: {exc}"[:200])
        with self._lock:
            self._done.append(out)

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)


__all__ = ["PROMPT", "USER_AGENT", "Canary", "CanaryPolicy", "ProbeOutcome", "ProbeSender",
           "probe_id"]
