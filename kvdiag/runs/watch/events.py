"""The sentinel's events: one JSON line each on stdout, one human line each on stderr."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TextIO

# The event names a consumer can rely on.
START = "start"
STALL = "stall"
VERDICT = "verdict"
REPORT = "report"     # the verdict's report folder is written (the verdict comes first, as soon as it is known)
RESTART = "restart"
RECOVERED = "recovered"
ERROR = "error"
STOP = "stop"
# The canary (--probe): a one-token request sent to an idle server, and how it ended.
PROBE = "probe"
PROBE_ANSWERED = "probe_answered"
PROBE_FAILED = "probe_failed"
EVENTS = (START, STALL, VERDICT, REPORT, RESTART, RECOVERED, ERROR, STOP, PROBE, PROBE_ANSWERED, PROBE_FAILED)


@dataclass(frozen=True)
class WatchEvent:
    """``event`` (one of :data:`EVENTS`) about ``engine`` (None: the watch itself) at Unix time ``wall``."""

    event: str
    engine: str | None
    wall: float
    fields: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> str:
        stamp = datetime.fromtimestamp(self.wall, timezone.utc).isoformat(timespec="milliseconds")
        head: dict[str, Any] = {"event": self.event, "ts": stamp, "unix": round(self.wall, 3)}
        if self.engine is not None:
            head["engine"] = self.engine
        return json.dumps({**head, **self.fields}, default=str, sort_keys=False)

    def human(self) -> str:
        """One line for a person reading stderr."""
        f = self.fields
        who = f"{self.engine}: " if self.engine else ""
        if self.event == STALL:
            core = f.get("engine_core") or {}
            where = (f"; EngineCore pid {core.get('pid')} state {core.get('state')} wchan {core.get('wchan')}"
                     if core else "")
            if f.get("probe"):
                return (f"{who}STALL: probe {f['probe'].get('id')} got no answer within {f.get('window_s')}s, "
                        f"/health {f.get('health')}{where}")
            return (f"{who}STALL: {f.get('in_flight')} request(s) in flight, no progress for "
                    f"{f.get('quiet_s')}s, /health {f.get('health')}{where}")
        if self.event == VERDICT:
            return f"{who}verdict {f.get('kind')} ({f.get('confidence')}): {f.get('summary')}; report {f.get('out')}"
        if self.event == REPORT:
            return f"{who}report written: {f.get('out')}"
        if self.event == RESTART:
            return f"{who}server restarted ({'; '.join(f.get('reasons', []))})"
        if self.event == RECOVERED:
            return f"{who}recovered from {f.get('what')} after {f.get('after_s')}s"
        if self.event == ERROR:
            return f"{who}{f.get('kind')}: {f.get('error')}"
        if self.event == PROBE:
            return f"{who}probe {f.get('id')} sent (one token)"
        if self.event == PROBE_ANSWERED:
            return f"{who}probe {f.get('id')} answered in {f.get('latency_s')}s"
        if self.event == PROBE_FAILED:
            return f"{who}probe {f.get('id')} failed after {f.get('after_s')}s: {f.get('error')}"
        if self.event == START:
            return (f"{who}watching {f.get('url')} (window {f.get('window_s')}s, "
                    f"EngineCore pid {f.get('engine_core_pid')}: {f.get('local')})")
        return f"{who}{self.event} {json.dumps(f, default=str)}"


class EventSink:
    """Writes each event as one JSON line to ``out`` (flushed) and hands it to every listener."""

    def __init__(self, out: TextIO, human: Callable[[str], None] | None = None) -> None:
        self._out = out
        self._human = human
        self._lock = threading.Lock()
        self.listeners: list[Callable[[WatchEvent], None]] = []
        self.counts: dict[str, int] = {}

    def emit(self, ev: WatchEvent) -> None:
        with self._lock:
            self.counts[ev.event] = self.counts.get(ev.event, 0) + 1
            try:
                self._out.write(ev.as_json() + "\n")
                self._out.flush()
            except (OSError, ValueError):
                pass   # a closed stdout (the reader went away) must not end the watch
            if self._human is not None:
                self._human(ev.human())
        for listener in self.listeners:
            listener(ev)


__all__ = ["ERROR", "EVENTS", "PROBE", "PROBE_ANSWERED", "PROBE_FAILED", "RECOVERED", "REPORT", "RESTART", "START",
           "STALL", "STOP", "VERDICT", "EventSink", "WatchEvent"]
