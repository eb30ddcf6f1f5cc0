"""Live progress of a soak on the terminal: tokens/s, requests, server gauges."""

from __future__ import annotations

from rich.console import Console
from rich.live import Live
from rich.text import Text

from kvdiag.model import MetricsSnapshot
from kvdiag.soak.loadgen import LoadGenerator


class ProgressView:
    """One status line, redrawn in place on a terminal; a plain line every ``every_s`` otherwise."""

    def __init__(self, console: Console, every_s: float = 5.0) -> None:
        self.console = console
        self.every_s = every_s
        self._live: Live | None = None
        self._last_print_t: float | None = None
        self._prev: tuple[float, int] | None = None
        self.rate = 0.0

    def start(self) -> None:
        if self.console.is_terminal:
            self._live = Live(Text(""), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def line(self, t: float, lg: LoadGenerator, snap: MetricsSnapshot | None, quiet_s: float) -> str:
        """The status text at run time ``t`` (seconds)."""
        if self._prev is not None and t > self._prev[0]:
            self.rate = (lg.tokens - self._prev[1]) / (t - self._prev[0])
        self._prev = (t, lg.tokens)
        parts = [f"{t:6.1f}s", f"{self.rate:7.0f} tok/s", f"in flight {lg.in_flight}",
                 f"ok {lg.ok}", f"failed {lg.failed + lg.timed_out}"]
        if snap is not None:
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

    def update(self, t: float, lg: LoadGenerator, snap: MetricsSnapshot | None, quiet_s: float) -> None:
        text = self.line(t, lg, snap, quiet_s)
        if self._live is not None:
            self._live.update(Text(text))
        elif self._last_print_t is None or t - self._last_print_t >= self.every_s:
            self._last_print_t = t
            self.console.print(text, highlight=False, markup=False)
