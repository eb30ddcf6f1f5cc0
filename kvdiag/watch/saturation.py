"""Readings of a load phase for the saturation judgement (:mod:`kvdiag.analyze.saturation`): the client's
requests in flight, CPU time of kvdiag's load loop, of the server's processes and of the whole machine.
Reads /proc and the clocks and nothing else; the judgement is analyze's, from what the bundle stores."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvdiag.defaults import Clock
from kvdiag.osread.host import cpu_times
from kvdiag.osread.stat import read_stat


def _ticks(pids: Iterable[int]) -> dict[int, int]:
    """utime+stime (clock ticks) of each pid that can still be read."""
    return {st.pid: st.utime + st.stime for st in (read_stat(pid) for pid in pids) if st is not None}


@dataclass
class SaturationSampler:
    """Readings of one load phase. :meth:`start` and :meth:`tick` must run on the load loop's thread."""

    requested: int
    server_pids: Sequence[int] = ()
    clock: Clock = time.monotonic
    _t0: float | None = None
    _thread0: float = 0.0
    _machine0: tuple[int, int] | None = None
    _server0: dict[int, int] = field(default_factory=dict)
    _in_flight_sum: float = 0.0
    _ticks: int = 0
    client_cpu: float | None = field(default=None, init=False)     # share of one core
    server_cpu: float | None = field(default=None, init=False)     # cores
    machine_busy: float | None = field(default=None, init=False)   # 0..1 over all CPUs
    in_flight_mean: float | None = field(default=None, init=False)
    wall_s: float = field(default=0.0, init=False)

    @property
    def started(self) -> bool:
        return self._t0 is not None

    def start(self) -> None:
        self._t0 = self.clock()
        self._thread0 = time.thread_time()
        self._machine0 = cpu_times()
        self._server0 = _ticks(self.server_pids)

    def tick(self, in_flight: int) -> None:
        """One look at the client while the load runs (the session's loop tick)."""
        if self._t0 is not None:
            self._in_flight_sum += in_flight
            self._ticks += 1

    def stop(self) -> None:
        """The loaded time is over: turn the readings into rates (once)."""
        if self._t0 is None or self.wall_s:
            return
        wall = self.clock() - self._t0
        self.wall_s = wall
        if wall <= 0:
            return
        self.client_cpu = (time.thread_time() - self._thread0) / wall
        m1 = cpu_times()
        if self._machine0 is not None and m1 is not None and m1[1] > self._machine0[1]:
            self.machine_busy = (m1[0] - self._machine0[0]) / (m1[1] - self._machine0[1])
        s1 = _ticks(self.server_pids)
        both = [pid for pid in s1 if pid in self._server0]   # a process gone meanwhile is left out
        if both:
            spent = sum(max(0, s1[pid] - self._server0[pid]) for pid in both)
            self.server_cpu = spent / (os.sysconf("SC_CLK_TCK") or 100) / wall
        if self._ticks:
            self.in_flight_mean = self._in_flight_sum / self._ticks


__all__ = ["SaturationSampler"]
