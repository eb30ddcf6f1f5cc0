"""No-progress watchdog and /metrics poller for a soak.

The watchdog is pure logic over an injected clock: requests in flight but no token
received for ``window_s`` is a stall; nothing in flight is idle, never a stall. A gap in
the watchdog's own observations (its caller's loop was starved of CPU) is not evidence:
the first look after such a gap never declares a stall, so tokens that arrived meanwhile are
read first. The poller scrapes ``/metrics`` every period on its own thread into
:class:`MetricsSnapshot` (KV usage, running, waiting, preemptions, generated tokens) with a
bounded timeout; a missed or late scrape is a gap in data, never read as a stall.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import httpx

from kvdiag.defaults import Clock
from kvdiag.model.run import MetricsSnapshot
from kvdiag.watch.metrics import parse_metrics


@dataclass(eq=False)
class MetricsPoller:
    """Scrapes ``{base_url}/metrics`` into snapshots on its own thread and timer.

    The load generator's event loop can be busy for long stretches (dozens of streams parsed on
    a small box); scrapes queued behind it would come late and make the server look quiet. The
    poller therefore runs in a thread of its own with a synchronous client: a scrape starts every
    ``period_s`` (right away when the previous one overran) whatever the load loop is doing.

    A snapshot's ``t`` (seconds since ``t0`` on ``clock``) is when its response arrived, i.e. when
    the values were read. :attr:`scrapes` counts attempts, :attr:`failures` the ones that got no
    snapshot, :attr:`longest_gap_s` the longest time between successive snapshots (from
    :meth:`start`): a gap is missing data, never evidence of a stall by itself.
    """

    base_url: str
    engine: str | None
    t0: float
    clock: Clock = time.monotonic
    timeout_s: float = 2.0
    period_s: float = 1.0
    max_snapshots: int = 100_000

    def __post_init__(self) -> None:
        if self.period_s <= 0:
            raise ValueError("period_s must be > 0")
        self.failures = 0
        self.scrapes = 0
        self.last_error: str | None = None
        self.longest_gap_s: float | None = None
        self._snapshots: list[MetricsSnapshot] = []
        self._lock = threading.Lock()           # snapshots and counters
        self._scrape_lock = threading.Lock()    # one scrape at a time (timer thread or poll())
        self._client: httpx.Client | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_ok: float | None = None      # clock time of the newest snapshot (or of start)

    # -- scraping ----------------------------------------------------------------------------------
    def poll(self) -> MetricsSnapshot | None:
        """One bounded scrape (blocking, any thread); the snapshot is also kept in :attr:`snapshots`."""
        with self._scrape_lock:
            if self._client is None:
                self._client = httpx.Client(trust_env=False, timeout=httpx.Timeout(self.timeout_s))
            with self._lock:
                self.scrapes += 1
            try:
                resp = self._client.get(f"{self.base_url}/metrics")
                error = None if resp.status_code == 200 else f"HTTP {resp.status_code}"
            except (httpx.HTTPError, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:200]
            now = self.clock()
            if error is not None:
                with self._lock:
                    self.failures += 1
                    self.last_error = error
                return None
            snap = parse_metrics(resp.text, round(now - self.t0, 3), self.engine)
            with self._lock:
                if self._last_ok is not None:
                    gap = now - self._last_ok
                    if self.longest_gap_s is None or gap > self.longest_gap_s:
                        self.longest_gap_s = gap
                self._last_ok = now
                if len(self._snapshots) >= self.max_snapshots:
                    # A very long soak: thin the older half to every other snapshot (bounded memory).
                    del self._snapshots[: len(self._snapshots) // 2 : 2]
                self._snapshots.append(snap)
            return snap

    async def poll_async(self) -> MetricsSnapshot | None:
        """:meth:`poll` from an event loop, without blocking it."""
        return await asyncio.to_thread(self.poll)

    @property
    def snapshots(self) -> list[MetricsSnapshot]:
        """A copy of the snapshots so far, oldest first."""
        with self._lock:
            return list(self._snapshots)

    @property
    def latest(self) -> MetricsSnapshot | None:
        with self._lock:
            return self._snapshots[-1] if self._snapshots else None

    def gap_now(self) -> float | None:
        """Seconds since the newest snapshot (or since :meth:`start`); None before either."""
        with self._lock:
            return None if self._last_ok is None else max(0.0, self.clock() - self._last_ok)

    # -- the timer thread --------------------------------------------------------------------------
    def start(self) -> None:
        """Scrape every ``period_s`` on a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            raise RuntimeError("poller already started")
        with self._lock:
            if self._last_ok is None:
                self._last_ok = self.clock()
        self._thread = threading.Thread(target=self._run, name="kvdiag-metrics-poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a parser bug must not end the scrapes
                with self._lock:
                    self.failures += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            next_t += self.period_s
            now = time.monotonic()
            if next_t < now:            # overran: start the next scrape now, no burst to catch up
                next_t = now
            self._stop.wait(next_t - now)

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the timer thread (bounded: a scrape in progress ends within its timeout) and
        close the client. The longest gap then also counts the time since the last snapshot."""
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout=self.timeout_s + 1.0 if timeout_s is None else timeout_s)
        with self._lock:
            if self._thread is not None and self._last_ok is not None:
                gap = self.clock() - self._last_ok
                if self.longest_gap_s is None or gap > self.longest_gap_s:
                    self.longest_gap_s = gap
        if t is None or not t.is_alive():
            self.close()

    def close(self) -> None:
        if self._scrape_lock.acquire(timeout=self.timeout_s + 1.0):
            try:
                if self._client is not None:
                    self._client.close()
                    self._client = None
            finally:
                self._scrape_lock.release()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.stop)
