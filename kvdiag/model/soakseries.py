"""What a soak's load generator counted over time: the series its report plots."""

from __future__ import annotations

from kvdiag.model.kinds import _Model


class SoakSample(_Model):
    """The client's counters at run time ``t`` (seconds, the timeline's clock)."""

    t: float
    tokens: int = 0                       # generated so far
    tokens_per_s: float | None = None     # since the previous sample
    in_flight: int = 0
    ok: int = 0
    failed: int = 0                       # failed or timed out
