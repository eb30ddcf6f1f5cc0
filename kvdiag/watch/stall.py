"""The one stall detector, over an injected clock, with a startup and a serving policy.

- startup (:class:`StallDetector`): no log line, no health, no CPU for a whole window, counted
  from the engine's first log line;
- serving (:class:`ServingStall`, also behind ``kvdiag soak``'s watchdog): requests in flight and
  no token for a whole window; nothing in flight is idle, never a stall.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvdiag.defaults import Clock


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
    stalled_since: float | None = None
    _serving: ServingStall | None = None

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
            # Serving: a decode stall is running requests with no new tokens (the serving policy).
            if self._serving is None:
                self._serving = ServingStall(self.window_s)
            stalled = self._serving.observe(int(obs.running), obs.tokens, now=obs.now)
            self.stalled_since = self._serving.onset if stalled else None
            return stalled
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
        if self._serving is not None:
            return self._serving.last_progress
        return self._last_progress


@dataclass
class ServingStall:
    """The serving policy: a stall once requests are in flight and no token arrived for ``window_s``.

    Feed it with :meth:`observe` as often as convenient. ``onset`` is the last moment of
    progress (the last token, or when requests became in flight after an idle spell). With
    ``max_blind_s``, an observation that comes more than that after the previous one never
    fires: the caller was not looking, and tokens it has not read yet may wait in its sockets.
    """

    window_s: float
    clock: Clock = time.monotonic
    max_blind_s: float | None = None
    onset: float | None = None           # last progress point, once stalled
    fired_at: float | None = None        # when the stall was declared
    blind_spells: int = 0                # observations skipped for firing after a gap
    longest_blind_s: float = 0.0         # longest gap between two observations
    _last_progress: float | None = None
    _last_tokens: float | None = None
    _was_busy: bool = False
    _last_observe: float | None = None

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")

    def observe(self, in_flight: int, tokens: float | None, last_token_t: float | None = None,
                now: float | None = None) -> bool:
        """One look at the load; True while stalled.

        ``tokens`` is a cumulative progress count (tokens received, plus requests the server
        answered; None: not known this time), ``last_token_t`` the clock time of its last
        increase when known, ``now`` the observation time (default: the clock).
        """
        now = self.clock() if now is None else now
        blind = False
        if self._last_observe is not None:
            gap = now - self._last_observe
            self.longest_blind_s = max(self.longest_blind_s, gap)
            blind = self.max_blind_s is not None and gap > self.max_blind_s
        self._last_observe = now
        if self._last_progress is None:
            self._last_progress = now
        if tokens is not None and (self._last_tokens is None or tokens > self._last_tokens):
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
            if blind:
                self.blind_spells += 1
                return False
            self.onset = self._last_progress
            self.fired_at = now
            return True
        return False

    @property
    def stalled(self) -> bool:
        return self.fired_at is not None

    @property
    def last_progress(self) -> float | None:
        return self._last_progress

    @property
    def quiet_for(self) -> float:
        """Seconds since the last progress point."""
        if self._last_progress is None:
            return 0.0
        return max(0.0, self.clock() - self._last_progress)
