"""Run-level judgements of a soak's load phase, pure over the bundle's facts.

- :func:`judged_soak`: the saturation judgement of the loaded time, from the readings and /metrics
  snapshots the bundle stores;
- :func:`saturation_verdict`: a soak without a hang whose KV pool never got near full tested
  nothing: the verdict becomes ``not_saturated`` (exit 6), naming the peak KV usage, the
  streams and the bottleneck the soak measured (``SoakStats.saturation_note``);
- :func:`served_verdict`: a healthy soak's summary names what the load showed (throughput, requests,
  KV peak, latencies);
- :func:`stall_to_verdict_s`: seconds from the run's "stall detected" event to its verdict;
- :func:`flat_generation_span`: how long the server's own token counter has been flat with requests
  running (the stall's confirmation from /metrics).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvdiag.analyze.saturation import StoredReadings, judge
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.run import MetricsSnapshot, SoakStats, TimelineEvent
from kvdiag.model.verdict import Verdict


def judged_soak(soak: SoakStats, metrics: Iterable[MetricsSnapshot]) -> SoakStats:
    """``soak`` with its saturation judged from the snapshots of its loaded time and the readings taken
    while it ran; as stored when the bundle names no loaded time."""
    lo, hi = soak.load_from_t, soak.load_until_t
    if lo is None or hi is None:
        return soak
    snaps = sorted((m for m in metrics if lo <= m.t <= hi), key=lambda m: m.t)
    sat = judge(snaps, StoredReadings(requested=soak.streams_requested or 0,
                                      in_flight_mean=soak.streams_in_flight_mean, client_cpu=soak.client_cpu,
                                      server_cpu=soak.server_cpu, machine_busy=soak.machine_cpu_busy))

    def r3(v: float | None) -> float | None:
        return None if v is None else round(v, 3)

    return soak.model_copy(update={
        "saturated": sat.saturated, "kv_usage_peak": r3(sat.kv_usage_peak),
        "server_running_peak": sat.running_peak, "server_running_mean": r3(sat.running_mean),
        "server_waiting_peak": sat.waiting_peak, "bottleneck": sat.bottleneck, "saturation_note": sat.note})


def saturation_verdict(verdict: Verdict, soak: SoakStats) -> Verdict:
    """``verdict``, or ``not_saturated`` when it is healthy and the soak never saturated the pool."""
    if verdict.kind is not VerdictKind.HEALTHY or soak.stalled or soak.saturated is not False:
        return verdict
    who = f"{verdict.engine}: " if verdict.engine else ""
    note = soak.saturation_note or "not saturated: the KV cache never got near full"
    return Verdict(kind=VerdictKind.NOT_SATURATED, confidence=Confidence.HIGH, engine=verdict.engine,
                   summary=f"{who}inconclusive: no stall, but {note}", findings=list(verdict.findings))


def served_verdict(verdict: Verdict, soak: SoakStats) -> Verdict:
    """A healthy soak's verdict says what the load showed, not only that the engine serves: time
    loaded, throughput, requests, the KV cache's peak and the latencies."""
    if verdict.kind is not VerdictKind.HEALTHY or soak.stalled:
        return verdict
    active = soak.duration_s + (soak.drain_s or 0.0)
    parts = [f"{soak.tokens / active:,.0f} tok/s" if active else None,
             f"{soak.requests_ok:,} requests ok" + (f", {soak.requests_failed + soak.requests_timed_out} failed"
                                                    if soak.requests_failed + soak.requests_timed_out else ""),
             None if soak.kv_usage_peak is None else f"KV cache peak {soak.kv_usage_peak:.0%}",
             None if soak.ttft_p50_s is None else f"TTFT p50 {soak.ttft_p50_s * 1000:.0f} ms",
             None if soak.itl_p50_s is None else f"ITL p50 {soak.itl_p50_s * 1000:.1f} ms"]
    figures = ", ".join(p for p in parts if p)
    return verdict.model_copy(update={
        "summary": f"{verdict.summary}; no stall in {soak.duration_s:.0f} s of load: {figures}"})


def stall_to_verdict_s(timeline: Iterable[TimelineEvent], verdict_t: float) -> float | None:
    """Seconds from the first "stall detected" event to ``verdict_t`` (run clock); None without one."""
    detected = [e.t for e in timeline if e.event == "stall detected"]
    if not detected:
        return None
    return round(max(0.0, verdict_t - min(detected)), 3)


def flat_generation_span(snaps: Sequence[MetricsSnapshot]) -> float:
    """Seconds over which the newest snapshots show the same generated-token count with requests running.

    0 when the last snapshot has no running requests or no token counter. The decode-stall
    rule needs this span to cover the stall window.
    """
    usable = [s for s in snaps if s.generation_tokens is not None]
    if not usable:
        return 0.0
    last = usable[-1]
    if (last.running or 0) <= 0:
        return 0.0
    i = len(usable) - 1
    while i > 0 and usable[i - 1].generation_tokens == last.generation_tokens and (usable[i - 1].running or 0) > 0:
        i -= 1
    return last.t - usable[i].t


__all__ = ["flat_generation_span", "judged_soak", "saturation_verdict", "served_verdict", "stall_to_verdict_s"]
