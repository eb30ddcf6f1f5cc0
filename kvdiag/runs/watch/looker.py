"""One bounded look at one server: GET /metrics, GET /health, and its local EngineCore in /proc."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from kvdiag.defaults import Clock
from kvdiag.runs.watch.local import LocalEngine
from kvdiag.watch.metrics import parse_server_metrics
from kvdiag.watch.reading import Look


@dataclass
class ServerLooker:
    """Looks at ``url`` (its /metrics and /health, each bounded by ``timeout_s``) and, when the server
    is local, at its EngineCore. Never raises for a server that is down or answers garbage."""

    url: str
    client: httpx.Client
    local: LocalEngine | None = None
    clock: Clock = time.monotonic
    wall: Clock = time.time
    timeout_s: float = 2.0

    def __call__(self) -> Look:
        metrics, error = None, None
        try:
            resp = self.client.get(f"{self.url}/metrics", timeout=self.timeout_s)
            if resp.status_code == 200:
                metrics = parse_server_metrics(resp.text)
            else:
                error = f"/metrics: HTTP {resp.status_code}"
        except (httpx.HTTPError, OSError) as exc:
            error = f"/metrics: {type(exc).__name__}: {exc}"[:200]
        t, wall = self.clock(), self.wall()   # when the values were read
        health: int | None = None
        try:
            health = self.client.get(f"{self.url}/health", timeout=min(self.timeout_s, 1.0)).status_code
        except (httpx.HTTPError, OSError):
            health = None
        server_pid, core = self.local.sample() if self.local is not None else (None, None)
        return Look(t=t, wall=wall, metrics=metrics, error=error, health=health,
                    server_pid=server_pid, core=core)


__all__ = ["ServerLooker"]
