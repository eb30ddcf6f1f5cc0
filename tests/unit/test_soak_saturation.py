"""The saturation judgement (pure) and the verdict it turns a healthy-but-unsaturated soak into."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvdiag.analyze.diagnosis import diagnose, exit_code_for
from kvdiag.analyze.saturation import judge
from kvdiag.analyze.soak import judged_soak, saturation_verdict, stall_to_verdict_s
from kvdiag.errors import ExitCode
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import EnginePhase, VerdictKind
from kvdiag.model.run import EngineRecord, MetricsSnapshot, SoakStats, TimelineEvent
from kvdiag.model.verdict import Verdict
from kvdiag.osread.host import cpu_times
from kvdiag.watch.saturation import SaturationSampler


def _snaps(kv: list[float], running: float, waiting: float = 0.0) -> list[MetricsSnapshot]:
    return [MetricsSnapshot(t=float(i), kv_cache_usage=u, running=running, waiting=waiting, generation_tokens=i * 10.0)
            for i, u in enumerate(kv)]


def _sampler(requested: int, in_flight: float | None, client_cpu: float | None = 0.3,
             server_cpu: float | None = 1.0, busy: float | None = 0.6) -> SaturationSampler:
    s = SaturationSampler(requested)
    s.in_flight_mean, s.client_cpu, s.server_cpu, s.machine_busy = in_flight, client_cpu, server_cpu, busy
    return s


def test_a_full_pool_is_saturated() -> None:
    sat = judge(_snaps([0.1, 0.6, 0.97, 0.8], running=22, waiting=9), _sampler(32, 31.8))
    assert sat.saturated is True and sat.kv_usage_peak == 0.97 and sat.bottleneck is None
    assert sat.note.startswith("saturated: KV cache peaked at 97%")
    assert sat.running_peak == 22 and sat.waiting_peak == 9


def test_the_client_short_of_streams_is_the_bottleneck() -> None:
    sat = judge(_snaps([0.1, 0.3, 0.46], running=5), _sampler(32, 6.5, client_cpu=0.97))
    assert sat.saturated is False and sat.bottleneck == "client"
    assert "KV cache peaked at 46% (< 90%)" in sat.note and "6.5 of 32 streams in flight" in sat.note


def test_a_cpu_bound_client_is_the_bottleneck() -> None:
    sat = judge(_snaps([0.3, 0.5], running=30), _sampler(32, 31.9, client_cpu=0.95))
    assert sat.bottleneck == "client" and "load loop used 95% of a core" in sat.note


def test_a_server_that_runs_few_of_the_requests_in_flight_is_the_bottleneck() -> None:
    """The seed's busy-machine case: 32 in flight at the client, 2-8 running, none waiting."""
    sat = judge(_snaps([0.2, 0.46, 0.3], running=5), _sampler(32, 31.5, client_cpu=0.2, server_cpu=0.4, busy=1.0))
    assert sat.saturated is False and sat.bottleneck == "server"
    assert "front end fell behind" in sat.note and "machine CPUs 100% busy" in sat.note
    assert "server processes 0.40 cores" in sat.note


def test_few_running_on_an_idle_machine_is_the_load_not_the_server() -> None:
    """Seen in CI: 2 streams, the server ran 1.3 on average with the machine 3 % busy and the server at
    0.06 cores: the gap is each request's turnaround outside the engine, not a starved front end."""
    sat = judge(_snaps([0.05, 0.11], running=1.3), _sampler(2, 2.0, client_cpu=0.02, server_cpu=0.06, busy=0.03))
    assert sat.bottleneck == "load", sat.note
    # the same gap with the server's processes at a core: still the load, since both streams running at
    # once would hold about 17 % of the pool (a new user's --concurrency 2 --max-tokens 16 was blamed on
    # the server's front end)
    sat = judge(_snaps([0.05, 0.11], running=1.3), _sampler(2, 2.0, client_cpu=0.02, server_cpu=0.95, busy=0.3))
    assert sat.bottleneck == "load", sat.note
    assert "even with all 2 streams running at once they would hold about 17%" in sat.note
    # a load that could fill the pool, with the server at a core and running few of it: the server's
    sat = judge(_snaps([0.05, 0.3], running=4), _sampler(16, 16.0, client_cpu=0.02, server_cpu=0.95, busy=0.3))
    assert sat.bottleneck == "server", sat.note


def test_a_load_too_small_for_the_pool() -> None:
    sat = judge(_snaps([0.05, 0.07], running=2), _sampler(2, 2.0))
    assert sat.bottleneck == "load" and "raise --concurrency or --max-tokens" in sat.note


def test_gauges_that_never_move_cannot_be_judged() -> None:
    """Seen on a kvdiag-launched vLLM CPU engine: the token counter climbs, running and KV usage stay 0."""
    snaps = [MetricsSnapshot(t=float(i), kv_cache_usage=0.0, running=0.0, waiting=0.0, generation_tokens=i * 700.0)
             for i in range(9)]
    sat = judge(snaps, _sampler(8, 7.7))
    assert sat.saturated is None and sat.bottleneck is None
    assert "stale gauges" in sat.note and "5600 generated tokens" in sat.note
    idle = [MetricsSnapshot(t=float(i), kv_cache_usage=0.0, running=0.0, generation_tokens=10.0) for i in range(3)]
    assert judge(idle, _sampler(8, 8.0)).saturated is False     # nothing generated: a real empty pool


def test_no_kv_gauge_cannot_be_judged() -> None:
    snaps = [MetricsSnapshot(t=0.0, running=3.0)]
    sat = judge(snaps, _sampler(8, 8.0))
    assert sat.saturated is None and sat.kv_usage_peak is None and "saturation unknown" in sat.note


def test_not_saturated_verdict_and_exit_code() -> None:
    healthy = Verdict(kind=VerdictKind.HEALTHY, summary="hybrid: serving", engine="hybrid")
    soak = SoakStats(saturated=False, saturation_note="not saturated: KV cache peaked at 46% (< 90%)")
    v = saturation_verdict(healthy, soak)
    assert v.kind is VerdictKind.NOT_SATURATED and not v.kind.is_hang
    assert v.summary == "hybrid: inconclusive: no stall, but not saturated: KV cache peaked at 46% (< 90%)"
    assert exit_code_for(v) == ExitCode.NOT_SATURATED == 6
    # a saturated, unknown or stalled soak, or a verdict that is not healthy, is left alone
    assert saturation_verdict(healthy, SoakStats(saturated=True)) is healthy
    assert saturation_verdict(healthy, SoakStats(saturated=None)) is healthy
    assert saturation_verdict(healthy, SoakStats(saturated=False, stalled=True)) is healthy
    stall = Verdict(kind=VerdictKind.DECODE_STALL, summary="x")
    assert saturation_verdict(stall, SoakStats(saturated=False)) is stall


def test_diagnose_judges_saturation_from_the_bundle_alone() -> None:
    """The run and `kvdiag analyze` reach the same verdict: the judgement reads only SoakStats."""
    def bundle(saturated: bool | None) -> Bundle:
        note = "not saturated: KV cache peaked at 31% (< 90%); bottleneck: load: too small" if saturated is False \
            else None
        return Bundle(command="soak", stall_window_s=5.0,
                      engines=[EngineRecord(name="hybrid", phase=EnginePhase.SERVING, healthy=True)],
                      soak=SoakStats(requests_ok=10, tokens=2560, saturated=saturated, saturation_note=note))

    diag = diagnose(bundle(False))
    assert diag.verdict.kind is VerdictKind.NOT_SATURATED and diag.exit_code == 6
    assert "KV cache peaked at 31%" in diag.verdict.summary
    assert any("inconclusive" in n for n in diag.notes)
    for sat in (True, None):
        d = diagnose(bundle(sat))
        assert d.verdict.kind is VerdictKind.HEALTHY and d.exit_code == 0
    failing = bundle(False)
    assert failing.soak is not None
    failing.soak.all_requests_failed = True            # every request failed: exit 1 wins
    assert diagnose(failing).exit_code == 1


def test_stall_to_verdict() -> None:
    tl = [TimelineEvent(t=1.0, event="soak load started"), TimelineEvent(t=12.5, event="stall detected"),
          TimelineEvent(t=14.0, event="capture finished")]
    assert stall_to_verdict_s(tl, 15.25) == 2.75
    assert stall_to_verdict_s(tl[:1], 15.25) is None


def test_sampler_reads_real_cpu_time() -> None:
    """A real child burning CPU shows up as server CPU; the machine counters move."""
    assert cpu_times() is not None
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 30\n"
                              "while time.monotonic() < end: pass"])
    try:
        s = SaturationSampler(4, [child.pid])
        s.start()
        for _ in range(4):
            s.tick(4)
            time.sleep(0.2)
        s.stop()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert s.in_flight_mean == 4.0 and s.wall_s > 0
    assert s.server_cpu is not None and s.server_cpu > 0.0
    assert s.machine_busy is not None and 0.0 < s.machine_busy <= 1.0
    assert s.client_cpu is not None and s.client_cpu >= 0.0
    assert os.sysconf("SC_CLK_TCK") > 0


def test_saturation_is_judged_from_the_readings_and_the_loaded_time_the_bundle_stores() -> None:
    """A bundle that names its loaded time is judged from its readings and the /metrics snapshots within it:
    a snapshot before the load (startup) or after it (the stall's confirmation) does not count."""
    snaps = [MetricsSnapshot(t=0.5, kv_cache_usage=0.99, running=0, generation_tokens=0.0)]    # before the load
    snaps += [MetricsSnapshot(t=1.0 + i, kv_cache_usage=u, running=8, waiting=0, generation_tokens=100.0 * i)
              for i, u in enumerate([0.1, 0.3, 0.4])]
    snaps.append(MetricsSnapshot(t=9.0, kv_cache_usage=0.98, running=8, generation_tokens=300.0))   # after it
    soak = SoakStats(requests_ok=10, tokens=2560, streams_requested=8, streams_in_flight_mean=7.9, client_cpu=0.1,
                     server_cpu=0.2, machine_cpu_busy=0.1, load_from_t=1.0, load_until_t=3.5)
    b = Bundle(command="soak", stall_window_s=5.0, metrics=snaps, soak=soak,
               engines=[EngineRecord(name="hybrid", phase=EnginePhase.SERVING, healthy=True)])
    judged = judged_soak(soak, snaps)
    assert judged.saturated is False and judged.kv_usage_peak == 0.4 and judged.bottleneck == "load"
    assert judged.saturation_note is not None and judged.saturation_note.startswith("not saturated: KV cache "
                                                                                     "peaked at 40%")
    diag = diagnose(b)
    assert diag.verdict.kind is VerdictKind.NOT_SATURATED and judged.saturation_note in diag.verdict.summary
    # without a loaded time (an older bundle) the judgement stays as the run stored it
    assert judged_soak(SoakStats(saturated=True), snaps).saturated is True
