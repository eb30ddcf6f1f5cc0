"""Percentiles, the bounded sample reservoir, and the soak summary."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdiag.load.stats import LatencySummary, SampleReservoir, SoakSummary, percentile


def test_percentile_linear_interpolation() -> None:
    v = [1.0, 2.0, 3.0, 4.0]
    assert percentile(v, 0) == 1.0
    assert percentile(v, 100) == 4.0
    assert percentile(v, 50) == 2.5                    # numpy: rank 1.5
    assert percentile(v, 99) == pytest.approx(3.97)    # rank 2.97
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(v, 101)


@given(st.lists(st.floats(min_value=0, max_value=1e3, allow_nan=False), min_size=1, max_size=200),
       st.floats(min_value=0, max_value=100))
def test_percentile_is_bounded_and_monotonic(values: list[float], q: float) -> None:
    s = sorted(values)
    p = percentile(s, q)
    assert p is not None and s[0] <= p <= s[-1]
    p2 = percentile(s, min(100.0, q + 1))
    assert p2 is not None and p2 >= p - 1e-9


def test_reservoir_keeps_everything_below_capacity() -> None:
    r = SampleReservoir(capacity=10)
    r.extend([3.0, 1.0, 2.0])
    assert r.sorted() == [1.0, 2.0, 3.0]
    assert r.count == 3 and r.mean == 2.0


def test_reservoir_is_bounded_and_unbiased_enough() -> None:
    r = SampleReservoir(capacity=1000, seed=3)
    for i in range(100_000):
        r.add(float(i % 100))
    assert len(r) == 1000 and r.count == 100_000
    s = LatencySummary.of(r)
    assert s.mean_s == pytest.approx(49.5)
    assert s.p50_s is not None and 40 <= s.p50_s <= 60   # a uniform subset of 0..99


def test_summary_to_soak_stats() -> None:
    ttft, itl = SampleReservoir(), SampleReservoir()
    ttft.extend([0.1, 0.2, 0.3])
    itl.extend([0.01] * 99 + [0.5])
    s = SoakSummary(duration_s=10.0, requests_sent=5, requests_ok=3, requests_failed=1, requests_timed_out=0,
                    requests_cancelled=1, tokens=100, ttft=LatencySummary.of(ttft), itl=LatencySummary.of(itl),
                    stalled=True, stall_after_s=4.25)
    stats = s.to_soak_stats()
    assert stats.requests_ok == 3 and stats.tokens == 100 and stats.stalled and stats.stall_after_s == 4.25
    assert stats.ttft_p50_s == pytest.approx(0.2)
    assert stats.itl_p50_s == pytest.approx(0.01)
    assert stats.itl_p99_s is not None and 0.01 < stats.itl_p99_s <= 0.5
    assert s.tokens_per_s == 10.0
    assert dict(s.table_rows())["stall"] == "after 4.2 s"
