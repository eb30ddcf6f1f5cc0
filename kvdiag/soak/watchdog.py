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

Clock = Callable[[], float]


@dataclass
class NoProgressWatchdog:
    """Declares a stall once requests are in flight and no token arrived for ``window_s``.

    Feed it with :meth:`observe` as often as convenient. ``onset`` is the last moment of
    progress (the last token, or when requests became in flight after an idle spell).
    """

    window_s: float
    clock: Clock = time.monotonic
    onset: float | None = None           # last progress point, once stalled
    fired_at: float | None = None        # when the stall was declared
    _last_progress: float | None = None
    _last_tokens: int | None = None
    _was_busy: bool = False

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")

    def observe(self, in_flight: int, tokens: int, last_token_t: float | None = None) -> bool:
        """One look at the load; True while stalled.

        ``tokens`` is a cumulative progress count (tokens received, plus requests the server
        answered), ``last_token_t`` the clock time of its last increase when known.
        """
        now = self.clock()
        if self._last_progress is None:
            self._last_progress = now
        if self._last_tokens is None or tokens > self._last_tokens:
            if self._last_tokens is not None:
                # The exact time of the newest token, when known, not this poll's time.
                t = last_token_t if last_token_t is not None and last_token_t <= now else now
                self._last_progress = max(self._last_progress, t)
            self._last_tokens = tokens
        if in_flight <= 0:
            self._last_progress = now
            self._was_busy = False
        elif not self._was_busy:
            self._was_busy = True
            self._last_progress = max(self._last_progress, now)
        if self.fired_at is not None:
            if self._last_progress > (self.onset or 0.0):
                self.onset = self.fired_at = None   # progress again: the stall is over
            else:
                return True
        if in_flight > 0 and now - self._last_progress >= self.window_s:
            self.onset = self._last_progress
            self.fired_at = now
            return True
        return False

    @property
    def stalled(self) -> bool:
        return self.fired_at is not None

    @property
    def quiet_for(self) -> float:
        """Seconds since the last progress point."""
        if self._last_progress is None:
            return 0.0
        return max(0.0, self.clock() - self._last_progress)


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
