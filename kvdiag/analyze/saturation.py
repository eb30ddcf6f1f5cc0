"""Did a soak saturate the engine, and if not, which side held it back?

A saturation soak is only evidence when the KV pool actually got near full: that is where the
seed's decode stall happens. The watch stage's sampler (:mod:`kvdiag.watch.saturation`) reads the
client's requests in flight and the CPU time of kvdiag's load loop, of the server's processes and of
the whole machine while the load runs; the bundle stores them. :func:`judge` turns them and the
/metrics snapshots of the loaded time into a :class:`Saturation`: peak KV usage, streams running on
the server vs requested, and the bottleneck:

- ``client``: kvdiag could not keep the requested streams in flight, or its load loop used
  (nearly) a whole core: the client, not the server, set the pace;
- ``server``: the client kept its streams in flight but the engine ran far fewer of them and
  queued none while CPU was short (the server's processes near a core, or the machine busy): its
  front end fell behind;
- ``load``: the load was too small for the pool (raise --concurrency or --max-tokens): client and
  server both kept up, or even every requested stream running at once would not have filled it (what
  each running stream held times the streams), whichever side was slower.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvdiag.defaults import KV_FULL
from kvdiag.model.run import MetricsSnapshot

CLIENT_IN_FLIGHT_SHORT = 0.9     # client kept fewer than this share of its streams in flight
CLIENT_CPU_BOUND = 0.85          # kvdiag's load loop used this share of one core or more
SERVER_BEHIND = 0.75             # server running+waiting below this share of the client's in flight
SERVER_CPU_BOUND = 0.85          # ... and its processes used this many cores or more
MACHINE_BUSY = 0.5               # ... or the machine's CPUs were at least this busy


class LoadReadings(Protocol):
    """What the watch stage read while the load ran (the sampler live, ``SoakStats`` from a bundle)."""

    @property
    def requested(self) -> int: ...
    @property
    def in_flight_mean(self) -> float | None: ...
    @property
    def client_cpu(self) -> float | None: ...
    @property
    def server_cpu(self) -> float | None: ...
    @property
    def machine_busy(self) -> float | None: ...


@dataclass(frozen=True)
class StoredReadings:
    """:class:`LoadReadings` as a bundle stores them."""

    requested: int
    in_flight_mean: float | None
    client_cpu: float | None
    server_cpu: float | None
    machine_busy: float | None


@dataclass(frozen=True)
class Saturation:
    """What the load phase reached, and why not more."""

    saturated: bool | None          # None: no KV usage gauge to judge from
    kv_usage_peak: float | None
    requested: int
    in_flight_mean: float | None    # client side
    running_peak: float | None      # server side (/metrics)
    running_mean: float | None
    waiting_peak: float | None
    client_cpu: float | None
    server_cpu: float | None
    machine_busy: float | None
    bottleneck: str | None          # "client", "server", "load"; None when saturated or unknown
    note: str                       # one sentence for the verdict line and the report


def _cpu_pressed(server_cpu: float | None, machine_busy: float | None) -> bool:
    """Could the server's front end have fallen behind for want of CPU? With the machine mostly idle and
    the server's processes far from a core, fewer running than the client holds in flight is each request's
    turnaround outside the engine (HTTP, admission) at a small load, not a server that could not keep up.
    Unknown readings do not rule it out."""
    if server_cpu is None and machine_busy is None:
        return True
    return ((server_cpu is not None and server_cpu >= SERVER_CPU_BOUND)
            or (machine_busy is not None and machine_busy >= MACHINE_BUSY))


def _load_ceiling(snaps: Sequence[MetricsSnapshot], requested: int) -> float | None:
    """The KV share all ``requested`` streams would hold if they all ran at once: the most any running
    stream held (KV usage over streams running, per snapshot) times the streams. Below the threshold, no
    server could have saturated with this load, whatever it ran. None: never a stream seen running."""
    per_stream = [s.kv_cache_usage / s.running for s in snaps
                  if s.kv_cache_usage is not None and s.running is not None and s.running > 0]
    if not per_stream or requested <= 0:
        return None
    return max(per_stream) * requested


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def judge(snaps: Sequence[MetricsSnapshot], sampler: LoadReadings,
          kv_threshold: float = KV_FULL) -> Saturation:
    """Saturation of one load phase from its /metrics snapshots and the readings taken while it ran."""
    kv = [s.kv_cache_usage for s in snaps if s.kv_cache_usage is not None]
    running = [s.running for s in snaps if s.running is not None]
    waiting = [s.waiting for s in snaps if s.waiting is not None]
    peak = max(kv) if kv else None
    run_peak = max(running) if running else None
    run_mean = sum(running) / len(running) if running else None
    wait_peak = max(waiting) if waiting else None
    wait_mean = sum(waiting) / len(waiting) if waiting else 0.0
    n = sampler.requested
    inflight = sampler.in_flight_mean
    ccpu, scpu, busy = sampler.client_cpu, sampler.server_cpu, sampler.machine_busy

    if run_mean is not None and run_peak is not None:
        streams = f"server ran {run_mean:.1f} of {n} requested streams on average (peak {run_peak:.0f}"
        streams += f", up to {wait_peak:.0f} waiting)" if wait_peak else ")"
    else:
        streams = f"{n} streams requested"
    if inflight is not None:
        streams += f", client kept {inflight:.1f} in flight"

    if peak is None:
        return Saturation(None, None, n, inflight, run_peak, run_mean, wait_peak, ccpu, scpu, busy, None,
                          f"saturation unknown: the server reports no KV cache usage gauge; {streams}")
    gen = [s.generation_tokens for s in snaps if s.generation_tokens is not None]
    generated = gen[-1] - gen[0] if len(gen) >= 2 else 0.0
    if peak <= 0 and not run_peak and generated > 0:
        # Tokens were generated with no request ever running and an empty pool: the gauges do not
        # follow the load (a stats path that is off or broken), so they cannot say it did not saturate.
        return Saturation(None, peak, n, inflight, run_peak, run_mean, wait_peak, ccpu, scpu, busy, None,
                          f"saturation unknown: /metrics counted {generated:.0f} generated tokens but its running "
                          f"and KV cache usage gauges stayed at 0 (stale gauges); {streams}")
    if peak >= kv_threshold:
        return Saturation(True, peak, n, inflight, run_peak, run_mean, wait_peak, ccpu, scpu, busy, None,
                          f"saturated: KV cache peaked at {_pct(peak)}; {streams}")

    if inflight is not None and inflight < CLIENT_IN_FLIGHT_SHORT * n:
        side, why = "client", f"it kept only {inflight:.1f} of {n} streams in flight"
    elif ccpu is not None and ccpu >= CLIENT_CPU_BOUND:
        side, why = "client", f"kvdiag's load loop used {_pct(ccpu)} of a core"
    elif (ceiling := _load_ceiling(snaps, n)) is not None and ceiling < kv_threshold:
        side, why = "load", (f"even with all {n} streams running at once they would hold about {_pct(ceiling)} "
                             "of the pool (what each running stream held, times the streams): the load is too "
                             "small for the pool (raise --concurrency or --max-tokens)")
    elif (inflight is not None and run_mean is not None
          and run_mean + wait_mean < SERVER_BEHIND * inflight and _cpu_pressed(scpu, busy)):
        side, why = "server", (f"it ran {run_mean:.1f} of the {inflight:.1f} requests in flight and queued none: "
                               "its front end fell behind")
    else:
        side, why = "load", "client and server kept up: the load is too small for the pool " \
                            "(raise --concurrency or --max-tokens)"
    cpu = [f"kvdiag's load loop {_pct(ccpu)} of a core" if ccpu is not None and side != "client" else "",
           f"server processes {scpu:.2f} cores" if scpu is not None else "",
           f"machine CPUs {_pct(busy)} busy" if busy is not None else ""]
    cpu_text = ", ".join(c for c in cpu if c)
    if cpu_text:
        why += f" ({cpu_text})"
    note = f"not saturated: KV cache peaked at {_pct(peak)} (< {_pct(kv_threshold)}); {streams}; " \
           f"bottleneck: {side}: {why}"
    return Saturation(False, peak, n, inflight, run_peak, run_mean, wait_peak, ccpu, scpu, busy, side, note)


__all__ = ["LoadReadings", "Saturation", "StoredReadings", "judge"]
