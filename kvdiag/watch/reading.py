"""What one look at a running server reads: its /metrics progress, /health, and its local EngineCore.

Pure data; the sentinel (:mod:`kvdiag.runs.watch.sentinel`) judges a sequence of looks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.watch.metrics import ServerMetrics


@dataclass(frozen=True)
class CoreSample:
    """The local EngineCore as /proc shows it at one look (main thread's state and wchan)."""

    pid: int
    state: str              # R, S, D, T (stopped), t (traced), Z ...
    wchan: str | None
    cpu_ticks: int          # utime + stime of the process, clock ticks


@dataclass(frozen=True)
class Look:
    """One look at one server. ``t`` is the injected monotonic clock, ``wall`` Unix time."""

    t: float
    wall: float
    metrics: ServerMetrics | None       # None: /metrics did not answer (``error`` says why)
    error: str | None = None
    health: int | None = None           # /health status code; None: no answer
    server_pid: int | None = None       # the local API server (the port's listener)
    core: CoreSample | None = None      # the local EngineCore


__all__ = ["CoreSample", "Look"]
