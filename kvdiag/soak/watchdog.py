"""No-progress watchdog and /metrics poller for a soak.

The watchdog is pure logic over an injected clock: requests in flight but no token
received for ``window_s`` is a stall; nothing in flight is idle, never a stall. The
poller scrapes ``/metrics`` once a period into :class:`MetricsSnapshot` (KV usage,
running, waiting, preemptions, generated tokens) with a bounded timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from kvdiag.model import MetricsSnapshot
from kvdiag.watch.probe import parse_metrics
from kvdiag.watch.stall import ServingStall

Clock = Callable[[], float]


# The soak's no-progress watchdog is the one stall detector's serving policy (kvdiag.watch.stall).
NoProgressWatchdog = ServingStall


def flat_generation_span(snaps: Sequence[MetricsSnapshot]) -> float:
    """Seconds over which the newest snapshots show the same generated-token count with requests running.

    0 when the last snapshot has no running requests or no token counter. The decode-stall
    rule needs this span to cover the stall window.
    """
    usable = [s for s in snaps if s.generation_tokens is not None]
    if not usable:
        return 0.0
    last = usable[-1]
    if (last.running or 0) <= 0:
        return 0.0
    i = len(usable) - 1
    while i > 0 and usable[i - 1].generation_tokens == last.generation_tokens and (usable[i - 1].running or 0) > 0:
        i -= 1
    return last.t - usable[i].t


@dataclass
class MetricsPoller:
    """Scrapes ``{base_url}/metrics`` into snapshots; times are seconds since ``t0`` on ``clock``."""

    base_url: str
    engine: str | None
    t0: float
    clock: Clock = time.monotonic
    timeout_s: float = 2.0
    snapshots: list[MetricsSnapshot] = field(default_factory=list)
    failures: int = 0
    last_error: str | None = None
    max_snapshots: int = 100_000
    _client: httpx.AsyncClient | None = None

    async def poll(self) -> MetricsSnapshot | None:
        """One bounded scrape; the snapshot is also appended to :attr:`snapshots`."""
        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(self.timeout_s))
        t = round(self.clock() - self.t0, 3)
        try:
            resp = await self._client.get(f"{self.base_url}/metrics")
        except (httpx.HTTPError, OSError) as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            return None
        if resp.status_code != 200:
            self.failures += 1
            self.last_error = f"HTTP {resp.status_code}"
            return None
        snap = parse_metrics(resp.text, t, self.engine)
        if len(self.snapshots) >= self.max_snapshots:
            # A very long soak: thin the older half to every other snapshot so memory stays bounded.
            del self.snapshots[: len(self.snapshots) // 2 : 2]
        self.snapshots.append(snap)
        return snap

    @property
    def latest(self) -> MetricsSnapshot | None:
        return self.snapshots[-1] if self.snapshots else None

    async def run(self, period_s: float, stop: asyncio.Event) -> None:
        """Poll every ``period_s`` until ``stop`` is set."""
        while not stop.is_set():
            started = self.clock()
            await self.poll()
            delay = max(0.0, period_s - (self.clock() - started))
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass

    async def aclose(self) -> None:
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.aclose(), timeout=self.timeout_s)
            except (asyncio.TimeoutError, httpx.HTTPError, OSError):
                pass
            self._client = None
