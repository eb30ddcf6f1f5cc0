"""Stall detection over an injected clock: no log, no health, no CPU, for a whole window."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Observation:
    """One poll of an engine. ``None`` means "not known this time"."""

    now: float
    new_log_lines: int
    cpu_ticks: int | None          # cumulative utime+stime of the engine's process group
    healthy: bool
    tokens: float | None = None    # cumulative generated tokens (serving engines)
    running: float | None = None   # requests running (serving engines)
    all_threads_blocked: bool | None = None
    output_started: bool | None = None  # the engine printed its first log line (None: not known)


@dataclass
class StallDetector:
    """Decides "stalled" once nothing has progressed for ``window_s``.

    Startup: progress = a new log line or CPU use above ``cpu_ticks_per_s``. Before the first
    log line the window is not applied at all (the interpreter is still starting, which on a busy
    machine takes longer than any stall window); the startup timeout bounds that phase.
    Serving: progress = tokens produced, or no request running (idle is not a stall).
    Pure logic; the caller supplies the clock through observations.
    """

    window_s: float
    cpu_ticks_per_s: float = 5.0   # 5 ticks/s = 5% of a core at USER_HZ=100
    _last_progress: float | None = None
    _last_cpu: int | None = None
    _last_cpu_t: float | None = None
    _last_tokens: float | None = None
    stalled_since: float | None = None

    def observe(self, obs: Observation) -> bool:
        """Feed one poll; returns True while the engine is stalled."""
        if self._last_progress is None:
            self._last_progress = obs.now
        if obs.output_started is False and not obs.healthy:
            # Not armed yet: the window counts from the first line the engine prints.
            self._last_progress = obs.now
            self._last_cpu = self._last_cpu_t = None
            self.stalled_since = None
            return False
        progressed = False
        if obs.healthy and obs.running is not None:
            # Serving: a decode stall is running requests with no new tokens.
            if obs.running <= 0:
                progressed = True
            elif obs.tokens is not None and self._last_tokens is not None and obs.tokens > self._last_tokens:
                progressed = True
            if obs.tokens is not None:
                self._last_tokens = obs.tokens
        else:
            if obs.new_log_lines > 0:
                progressed = True
            if obs.cpu_ticks is not None:
                # Rate since the last progress point, over at least a second: single clock
                # ticks over short polls would otherwise look like activity.
                if self._last_cpu is None or self._last_cpu_t is None:
                    self._last_cpu, self._last_cpu_t = obs.cpu_ticks, obs.now
                else:
                    dt = obs.now - self._last_cpu_t
                    used = obs.cpu_ticks - self._last_cpu
                    if dt >= 1.0 and used > 2 and used / dt > self.cpu_ticks_per_s:
                        progressed = True
                    if dt >= 1.0:
                        self._last_cpu, self._last_cpu_t = obs.cpu_ticks, obs.now
            if obs.all_threads_blocked is False:
                progressed = progressed or obs.cpu_ticks is None
        if progressed:
            self._last_progress = obs.now
            self.stalled_since = None
            return False
        if obs.now - self._last_progress >= self.window_s:
            if self.stalled_since is None:
                self.stalled_since = self._last_progress
            return True
        return False

    @property
    def quiet_since(self) -> float | None:
        return self._last_progress
