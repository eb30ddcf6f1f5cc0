"""No-progress watchdog on an injected clock, and the flat-token span of /metrics snapshots."""

from __future__ import annotations

from kvdiag.analyze.soak import flat_generation_span
from kvdiag.model.run import MetricsSnapshot
from kvdiag.watch.stall import ServingStall


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_stall_after_window_with_requests_in_flight() -> None:
    clk = FakeClock()
    wd = ServingStall(5.0, clock=clk)
    tokens = 0
    for _ in range(20):               # 2 s of steady tokens
        clk.t += 0.1
        tokens += 3
        assert not wd.observe(32, tokens, clk.t - 0.05)
    last_token = clk.t - 0.05
    for _ in range(49):               # 4.9 s without tokens: not yet
        clk.t += 0.1
        assert not wd.observe(32, tokens, last_token)
    clk.t += 0.2
    assert wd.observe(32, tokens, last_token)
    assert wd.stalled and wd.onset == last_token and wd.fired_at == clk.t
    clk.t += 1.0
    assert wd.observe(32, tokens, last_token)          # stays stalled
    clk.t += 0.1
    assert not wd.observe(32, tokens + 1, clk.t)       # a token: over
    assert not wd.stalled


def test_idle_is_not_a_stall() -> None:
    clk = FakeClock()
    wd = ServingStall(1.0, clock=clk)
    for _ in range(100):
        clk.t += 0.5
        assert not wd.observe(0, 0)
    # requests start now: the window counts from here, not from the last token long ago
    clk.t += 0.5
    assert not wd.observe(4, 0)
    clk.t += 0.9
    assert not wd.observe(4, 0)
    clk.t += 0.2
    assert wd.observe(4, 0)
    assert wd.onset is not None and abs(wd.onset - (clk.t - 1.1)) < 1e-9


def test_first_observation_with_tokens_is_not_progress_from_the_past() -> None:
    clk = FakeClock()
    wd = ServingStall(2.0, clock=clk)
    assert not wd.observe(8, 500, last_token_t=clk.t - 60)   # an old count: baseline only
    clk.t += 2.0
    assert wd.observe(8, 500, last_token_t=clk.t - 62)


def test_quiet_for() -> None:
    clk = FakeClock()
    wd = ServingStall(10.0, clock=clk)
    wd.observe(1, 0)
    clk.t += 3.0
    assert wd.quiet_for == 3.0


def test_a_gap_in_observing_is_not_a_stall() -> None:
    """The caller's loop starved for longer than the window: the first look after the gap does not
    fire (tokens may wait unread in its sockets); the next one, with still no token, does."""
    clk = FakeClock()
    wd = ServingStall(5.0, clock=clk, max_blind_s=1.0)
    assert not wd.observe(8, 100, clk.t)
    clk.t += 6.0                                   # no observation for 6 s
    assert not wd.observe(8, 100, clk.t - 6.0)
    assert wd.blind_spells == 1 and wd.longest_blind_s == 6.0 and not wd.stalled
    clk.t += 0.25                                  # tokens that were waiting: progress, no stall
    assert not wd.observe(8, 130, clk.t)
    clk.t += 6.0
    assert not wd.observe(8, 130, clk.t - 6.0)     # another gap: still not read as a stall
    clk.t += 0.25
    assert wd.observe(8, 130, clk.t - 6.25)        # looked again, still nothing: a stall
    assert wd.onset == clk.t - 6.25


def _snap(t: float, gen: float | None, running: float | None) -> MetricsSnapshot:
    return MetricsSnapshot(t=t, generation_tokens=gen, running=running, kv_cache_usage=0.99)


def test_flat_generation_span() -> None:
    snaps = [_snap(0, 10, 4), _snap(1, 20, 4), _snap(2, 30, 4), _snap(3, 30, 4), _snap(4.5, 30, 4)]
    assert flat_generation_span(snaps) == 2.5
    assert flat_generation_span(snaps + [_snap(5, 31, 4)]) == 0.0
    assert flat_generation_span(snaps + [_snap(5, 30, 0)]) == 0.0    # nothing running: idle
    assert flat_generation_span([]) == 0.0
    assert flat_generation_span([_snap(0, None, 4)]) == 0.0
