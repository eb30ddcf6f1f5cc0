"""Latency samples, percentiles and the soak's summary (→ :class:`kvdiag.model.run.SoakStats`)."""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvdiag.model.run import SoakStats


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of already sorted values, linearly interpolated.

    Same definition as numpy's default (and so ``vllm bench serve``): rank ``q/100 * (n-1)``.
    None for no values.
    """
    n = len(sorted_values)
    if n == 0:
        return None
    if not 0.0 <= q <= 100.0 or math.isnan(q):
        raise ValueError(f"percentile must be within 0..100, got {q}")
    rank = q / 100.0 * (n - 1)
    lo = int(math.floor(rank))
    hi = min(lo + 1, n - 1)
    frac = rank - lo
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac)


class SampleReservoir:
    """Latency samples in compact storage; beyond ``capacity`` a uniform random subset is kept.

    Percentiles of a long soak stay unbiased while memory stays bounded (Vitter's algorithm R).
    """

    def __init__(self, capacity: int = 2_000_000, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.count = 0
        self.total = 0.0
        self._values = array("d")
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if len(self._values) < self.capacity:
            self._values.append(value)
            return
        j = self._rng.randrange(self.count)
        if j < self.capacity:
            self._values[j] = value

    def extend(self, values: Sequence[float]) -> None:
        for v in values:
            self.add(v)

    def sorted(self) -> list[float]:
        return sorted(self._values)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass(frozen=True)
class LatencySummary:
    count: int
    mean_s: float | None
    p50_s: float | None
    p99_s: float | None
    max_s: float | None

    @classmethod
    def of(cls, samples: SampleReservoir) -> LatencySummary:
        values = samples.sorted()
        return cls(count=samples.count, mean_s=samples.mean, p50_s=percentile(values, 50),
                   p99_s=percentile(values, 99), max_s=values[-1] if values else None)


@dataclass(frozen=True)
class SoakSummary:
    """What one soak measured, client side."""

    duration_s: float
    requests_sent: int
    requests_ok: int
    requests_failed: int
    requests_timed_out: int
    requests_cancelled: int
    tokens: int
    ttft: LatencySummary
    itl: LatencySummary
    stalled: bool = False
    stall_after_s: float | None = None
    drain_s: float | None = None          # after the loaded time: requests in flight finishing
    drain_in_flight: int | None = None    # in flight when the drain began
    drain_cut: int | None = None          # still in flight when it ended (cancelled)

    @property
    def active_s(self) -> float:
        """Loaded time plus the drain: the span over which the counted tokens arrived."""
        return self.duration_s + (self.drain_s or 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.active_s if self.active_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests_ok / self.active_s if self.active_s > 0 else 0.0

    def to_soak_stats(self) -> SoakStats:
        """The bundle's SoakStats (cancelled requests = sent - ok - failed - timed out)."""
        return SoakStats(
            requests_sent=self.requests_sent, requests_ok=self.requests_ok,
            requests_failed=self.requests_failed, requests_timed_out=self.requests_timed_out,
            tokens=self.tokens, duration_s=round(self.duration_s, 3),
            ttft_p50_s=_r(self.ttft.p50_s), ttft_p99_s=_r(self.ttft.p99_s),
            itl_p50_s=_r(self.itl.p50_s), itl_p99_s=_r(self.itl.p99_s),
            stalled=self.stalled, stall_after_s=_r(self.stall_after_s, 3),
            drain_s=_r(self.drain_s, 3), drain_in_flight=self.drain_in_flight, drain_cut=self.drain_cut,
        )

    def table_rows(self) -> list[tuple[str, str]]:
        """(label, value) rows for a terminal table."""
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1000:.2f} ms"

        drain = ("-" if self.drain_s is None else
                 f"{self.drain_s:.1f} s ({(self.drain_in_flight or 0) - (self.drain_cut or 0)} of "
                 f"{self.drain_in_flight or 0} in flight finished, {self.drain_cut or 0} cancelled)")
        return [
            ("duration (loaded)", f"{self.duration_s:.1f} s"),
            ("drain", drain),
            ("requests ok / failed / timed out / cancelled",
             f"{self.requests_ok} / {self.requests_failed} / {self.requests_timed_out} / {self.requests_cancelled}"),
            ("tokens", f"{self.tokens} ({self.tokens_per_s:.1f} tok/s)"),
            ("TTFT p50 / p99", f"{ms(self.ttft.p50_s)} / {ms(self.ttft.p99_s)}"),
            ("ITL p50 / p99", f"{ms(self.itl.p50_s)} / {ms(self.itl.p99_s)}"),
            ("stall", f"after {self.stall_after_s:.1f} s" if self.stalled and self.stall_after_s is not None
             else ("yes" if self.stalled else "no")),
        ]


def _r(v: float | None, digits: int = 6) -> float | None:
    return None if v is None else round(v, digits)
