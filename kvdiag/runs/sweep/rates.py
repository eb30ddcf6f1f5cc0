"""Rates from repeated runs: an exact binomial confidence interval and small distributions. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvdiag.model.sweep import Distribution, Interval

INTERVAL_LEVEL = 0.95


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return math.fsum(math.comb(n, i) * p ** i * (1.0 - p) ** (n - i) for i in range(k + 1))


def _solve(target: float, k: int, n: int, upper: bool) -> float:
    """The p where a binomial tail probability equals ``target``, by bisection (the tail is monotone
    in p). ``upper``: P(X <= k) = target (falls as p grows); else P(X >= k) = target (rises)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        tail = _binom_cdf(k, n, mid) if upper else 1.0 - _binom_cdf(k - 1, n, mid)
        if (tail > target) == upper:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, level: float = INTERVAL_LEVEL) -> Interval:
    """Exact two-sided interval for k successes in n trials (Clopper-Pearson): conservative, never
    narrower than the nominal level, and well defined at 0/n and n/n where the normal approximation
    is not (0/10 gives [0, 30.8 %])."""
    if n <= 0:
        return Interval(low=0.0, high=1.0, level=level)
    if not 0 <= k <= n:
        raise ValueError(f"k={k} outside 0..{n}")
    alpha = 1.0 - level
    low = 0.0 if k == 0 else _solve(alpha / 2, k, n, upper=False)
    high = 1.0 if k == n else _solve(alpha / 2, k, n, upper=True)
    return Interval(low=round(low, 4), high=round(high, 4), level=level)


def percent(p: float) -> str:
    """31 %, 0.5 %, 100 % (one decimal below 10 %)."""
    v = p * 100
    if v == 0 or v >= 10:
        return f"{v:.0f} %"
    return f"{v:.1f} %"


def rate_text(label: str, k: int, n: int, iv: Interval) -> str:
    """"fixed 0/10 hung, 95 % bound ≤ 31 %" / "stock 10/10 hung, 95 % bound ≥ 69 %" / "k/n, 95 % CI a–b"."""
    level = f"{iv.level * 100:.0f} %"
    if k == 0:
        bound = f"{level} bound ≤ {percent(iv.high)}"
    elif k == n:
        bound = f"{level} bound ≥ {percent(iv.low)}"
    else:
        bound = f"{level} CI {percent(iv.low)}–{percent(iv.high)}"
    return f"{label} {k}/{n} hung, {bound}"


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> Distribution | None:
    """min / median / p90 / max of ``values`` (None when there are none)."""
    if not values:
        return None
    s = sorted(values)
    return Distribution(n=len(s), min=round(s[0], 3), median=round(_quantile(s, 0.5), 3),
                        p90=round(_quantile(s, 0.9), 3), max=round(s[-1], 3))
