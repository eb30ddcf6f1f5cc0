"""Live progress of a soak on the terminal: tokens/s, requests, server gauges."""

from __future__ import annotations

from collections import deque

from rich.console import Console
from rich.live import Live
from rich.text import Text

from kvdiag.load.loadgen import LoadGenerator
from kvdiag.model.run import MetricsSnapshot


class ProgressView:
    """One status line, redrawn in place on a terminal; a plain line every ``every_s`` otherwise."""

    def __init__(self, console: Console, every_s: float = 5.0, window_s: float = 5.0) -> None:
        self.console = console
        self.every_s = every_s
        self.window_s = window_s
        self._live: Live | None = None
        self._last_print_t: float | None = None
        self._samples: deque[tuple[float, int]] = deque()
        self.rate = 0.0

    def start(self) -> None:
        if self.console.is_terminal:
            self._live = Live(Text(""), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def line(self, t: float, lg: LoadGenerator, snap: MetricsSnapshot | None, quiet_s: float,
             fresh_after: float | None = None) -> str:
        """The status text at run time ``t`` (seconds).

        The rate is over the last ``window_s`` seconds (tokens counted by the load generator, as the
        summary counts them), not between two redraws a fraction of a second apart: bursty streams
        would read 0 tok/s between bursts while thousands of tokens flowed. The running total is
        shown beside it, the figure the summary's average divides by the load time. The server's
        gauges are shown only from a scrape taken after ``fresh_after`` (the load's start, run time):
        an idle server's zeros beside 32 requests in flight would read as a server that runs nothing.
        """
        self._samples.append((t, lg.tokens))
        while len(self._samples) > 2 and self._samples[1][0] <= t - self.window_s:
            self._samples.popleft()
        t0, tokens0 = self._samples[0]
        if t > t0:
            self.rate = (lg.tokens - tokens0) / (t - t0)
        span = min(self.window_s, t - t0)
        rate = f"{self.rate:7.0f} tok/s (last {span:.0f}s)" if span >= 0.5 else "      - tok/s"
        parts = [f"{t:6.1f}s", rate, f"{lg.tokens} tokens",
                 f"in flight {lg.in_flight}", f"ok {lg.ok}", f"failed {lg.failed + lg.timed_out}"]
        if snap is not None and fresh_after is not None and snap.t < fresh_after:
            parts.append("server gauges: no /metrics scrape under load yet")
        elif snap is not None:
            if snap.running is not None:
                parts.append(f"running {snap.running:.0f}")
            if snap.waiting is not None:
                parts.append(f"waiting {snap.waiting:.0f}")
            if snap.kv_cache_usage is not None:
                parts.append(f"KV {snap.kv_cache_usage:.1%}")
            if snap.preemptions is not None:
                parts.append(f"preempted {snap.preemptions:.0f}")
        if quiet_s >= 1.0 and lg.in_flight:
            parts.append(f"no token for {quiet_s:.0f}s")
        return " | ".join(parts)

    def update(self, t: float, lg: LoadGenerator, snap: MetricsSnapshot | None, quiet_s: float,
               fresh_after: float | None = None) -> None:
        text = self.line(t, lg, snap, quiet_s, fresh_after)
        if self._live is not None:
            self._live.update(Text(text))
        elif self._last_print_t is None or t - self._last_print_t >= self.every_s:
            self._last_print_t = t
            self.console.print(text, highlight=False, markup=False)
