"""Soak stage: saturating streaming load on one engine, a no-progress watchdog, capture on a stall.

Entry points: :func:`run_soak` (the `kvdiag soak` pipeline), :class:`LoadGenerator`
(N streaming clients), :class:`SSEParser`, :class:`NoProgressWatchdog`,
:class:`MetricsPoller` and the percentile helpers in :mod:`kvdiag.soak.stats`.
"""

from kvdiag.soak.loadgen import LoadConfig, LoadGenerator, RequestRecord, RequestStatus
from kvdiag.soak.session import SoakOptions, SoakRun, run_soak
from kvdiag.soak.sse import SSEEvent, SSEParser, SSEProtocolError
from kvdiag.soak.stats import LatencySummary, SampleReservoir, SoakSummary, percentile
from kvdiag.soak.watchdog import MetricsPoller, NoProgressWatchdog, flat_generation_span

__all__ = [
    "LatencySummary", "LoadConfig", "LoadGenerator", "MetricsPoller", "NoProgressWatchdog", "RequestRecord",
    "RequestStatus", "SSEEvent", "SSEParser", "SSEProtocolError", "SampleReservoir", "SoakOptions", "SoakRun",
    "SoakSummary", "flat_generation_span", "percentile", "run_soak",
]
