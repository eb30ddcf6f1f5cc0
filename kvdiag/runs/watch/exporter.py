"""The sentinel's own HTTP port: Prometheus metrics (stalls named, the last verdict, scrape errors,
restarts, probes) at ``/metrics`` and readiness from progress at ``/ready``.

Fed only from events and the trackers (it never looks at a server itself), on a registry of its
own so nothing of kvdiag's process leaks in besides what is defined here. ``/ready`` answers 200
while every engine progresses or is idle (and, with --probe, answers its probe), 503 while one is
stalled or does not answer; ``/ready/<engine>`` (or ``/ready?engine=<engine>``) the same for one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs, unquote
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvdiag.runs.watch.events import PROBE, PROBE_ANSWERED, PROBE_FAILED, STALL, VERDICT, WatchEvent
from kvdiag.runs.watch.sentinel import EngineTracker


class WatchExporter:
    """Metrics named ``kvdiag_watch_*``; :meth:`on_event` is an :class:`EventSink` listener."""

    def __init__(self, trackers: Sequence[EngineTracker] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.stalls = Counter("kvdiag_watch_stalls", "Stalls named, by engine and verdict kind "
                              "(kind 'uncaptured' when no capture ran: not local, or in cooldown).",
                              ["engine", "kind"], registry=r)
        self.last_verdict = Gauge("kvdiag_watch_last_verdict", "1 for the kind of the last verdict of each engine.",
                                  ["engine", "kind"], registry=r)
        self.last_verdict_time = Gauge("kvdiag_watch_last_verdict_timestamp_seconds",
                                       "Unix time of the last verdict.", ["engine"], registry=r)
        self.up = Gauge("kvdiag_watch_engine_up", "1 while the engine's /metrics answers.", ["engine"], registry=r)
        self.in_flight = Gauge("kvdiag_watch_requests_in_flight", "Requests running or waiting (last look).",
                               ["engine"], registry=r)
        self.quiet = Gauge("kvdiag_watch_seconds_without_progress",
                           "Seconds since the engine last made progress while requests were in flight.",
                           ["engine"], registry=r)
        self.probes = Counter("kvdiag_watch_probes", "Canary requests (--probe) by outcome: sent, answered, "
                              "failed (no answer within the window, or an error).", ["engine", "outcome"],
                              registry=r)
        self.probe_latency = Gauge("kvdiag_watch_probe_latency_seconds", "Time to the last answered probe's "
                                   "token.", ["engine"], registry=r)
        self.ready = Gauge("kvdiag_watch_ready", "1 while the engine progresses or is idle (what /ready says).",
                           ["engine"], registry=r)
        self._kinds: dict[str, str] = {}
        self._trackers = list(trackers)
        self._server: WSGIServer | None = None
        r.register(_TrackerCounters(self._trackers))
        for tr in self._trackers:
            self.up.labels(tr.name).set_function(partial(_up, tr))
            self.in_flight.labels(tr.name).set_function(partial(_in_flight, tr))
            self.quiet.labels(tr.name).set_function(partial(_quiet, tr))
            self.ready.labels(tr.name).set_function(partial(_ready, tr))

    def on_event(self, ev: WatchEvent) -> None:
        engine = ev.engine or ""
        if ev.event in _PROBE_OUTCOMES:
            self.probes.labels(engine, _PROBE_OUTCOMES[ev.event]).inc()
            if ev.event == PROBE_ANSWERED and ev.fields.get("latency_s") is not None:
                self.probe_latency.labels(engine).set(float(ev.fields["latency_s"]))
        elif ev.event == STALL and not ev.fields.get("capture"):
            self.stalls.labels(engine, "uncaptured").inc()
        elif ev.event == VERDICT:
            kind = str(ev.fields.get("kind", "unknown"))
            self.stalls.labels(engine, kind).inc()
            old = self._kinds.get(engine)
            if old is not None and old != kind:
                self.last_verdict.labels(engine, old).set(0)
            self._kinds[engine] = kind
            self.last_verdict.labels(engine, kind).set(1)
            self.last_verdict_time.labels(engine).set(ev.wall)

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def readiness(self, engine: str | None = None) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /ready: every engine, or the one named."""
        trackers = self._trackers if engine is None else [t for t in self._trackers if t.name == engine]
        if not trackers:
            return 404, {"error": f"no engine {engine!r}", "engines": [t.name for t in self._trackers]}
        engines = {}
        for tr in trackers:
            ok, why = tr.ready
            engines[tr.name] = {"ready": ok, "why": why}
        ready = all(e["ready"] for e in engines.values())
        return (200 if ready else 503), {"ready": ready, "engines": engines}

    def wsgi(self) -> Callable[[dict[str, Any], Any], Iterable[bytes]]:
        """/ready[/<engine>] from the trackers; everything else is the Prometheus exposition."""
        metrics = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "") or "/"
            if path == "/ready" or path.startswith("/ready/"):
                engine = unquote(path[len("/ready/"):]) if path.startswith("/ready/") else None
                engine = engine or parse_qs(environ.get("QUERY_STRING", "")).get("engine", [None])[0]
                status, body = self.readiness(engine)
                data = (json.dumps(body) + "\n").encode()
                start_response(f"{status} {_REASONS[status]}", [("Content-Type", "application/json"),
                                                                 ("Content-Length", str(len(data)))])
                return [data]
            return metrics(environ, start_response)  # type: ignore[no-any-return]

        return app

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics and /ready on ``addr:port`` (0: any free port) from a daemon thread; returns the port."""
        server = make_server(addr, port, self.wsgi(), _ThreadingServer, handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name="kvdiag-watch-http", daemon=True).start()
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _TrackerCounters(Collector):
    """Counters the trackers keep themselves: every failed look, every restart."""

    def __init__(self, trackers: Sequence[EngineTracker]) -> None:
        self._trackers = trackers

    def collect(self) -> Iterator[Metric]:
        errors = CounterMetricFamily("kvdiag_watch_scrape_errors", "Looks at /metrics that got no answer.",
                                     labels=["engine"])
        restarts = CounterMetricFamily("kvdiag_watch_restarts", "Server restarts seen.", labels=["engine"])
        for tr in self._trackers:
            errors.add_metric([tr.name], tr.scrape_errors)
            restarts.add_metric([tr.name], tr.restarts)
        yield errors
        yield restarts


_PROBE_OUTCOMES = {PROBE: "sent", PROBE_ANSWERED: "answered", PROBE_FAILED: "failed"}
_REASONS = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request: a slow scraper never holds up a readiness probe."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access line on stderr per scrape or probe: stderr is the watch's own."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the signature of the base class
        return


def _ready(tr: EngineTracker) -> float:
    return 1.0 if tr.ready[0] else 0.0


def _up(tr: EngineTracker) -> float:
    return 1.0 if tr.reachable else 0.0


def _quiet(tr: EngineTracker) -> float:
    return tr.quiet_s if _in_flight(tr) else 0.0


def _in_flight(tr: EngineTracker) -> float:
    look = tr.last_look
    if look is None or look.metrics is None:
        return 0.0
    return float(look.metrics.in_flight or 0)


__all__ = ["WatchExporter"]
