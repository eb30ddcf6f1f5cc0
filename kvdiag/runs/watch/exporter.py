"""The sentinel's own Prometheus endpoint: stalls named, the last verdict, scrape errors, restarts.

Fed only from events and the trackers (it never looks at a server itself), on a registry of its
own so nothing of kvdiag's process leaks in besides what is defined here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvdiag.runs.watch.events import STALL, VERDICT, WatchEvent
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
        self._kinds: dict[str, str] = {}
        self._trackers = list(trackers)
        self._server: WSGIServer | None = None
        r.register(_TrackerCounters(self._trackers))
        for tr in self._trackers:
            self.up.labels(tr.name).set_function(partial(_up, tr))
            self.in_flight.labels(tr.name).set_function(partial(_in_flight, tr))
            self.quiet.labels(tr.name).set_function(partial(_quiet, tr))

    def on_event(self, ev: WatchEvent) -> None:
        engine = ev.engine or ""
        if ev.event == STALL and not ev.fields.get("capture"):
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

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``addr:port`` (0: any free port) from a daemon thread; returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
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
