"""What a soak's report shows first: its figures with their units, and its measurements over time.

Built once from the bundle (``SoakStats`` and its client series, the /metrics snapshots, the
timeline's stall events) and read by the HTML and Markdown renderers. Plots are inline SVG paths
(no script, no network); every number shown comes from the bundle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdiag.model.bundle import Bundle
from kvdiag.model.report import Report
from kvdiag.model.run import MetricsSnapshot, SoakStats, TimelineEvent

PLOT_W, PLOT_H = 370, 140   # three side by side on a laptop's first screen
_LEFT, _RIGHT, _TOP, _BOTTOM = 52, 12, 12, 24
# The labels are 11 px sans-serif; a glyph is at most this wide on average (digits and lower case), so a label's
# box estimated with it holds the rendered text: marks' labels are laid out in rows without overlapping.
_CHAR_W, _ROW_H, _FIRST_ROW, _ROWS = 6.6, 14, 22, 4


@dataclass
class Figure:
    label: str
    value: str
    note: str = ""
    key: str = ""                    # a stable id for the page (soak-fig-<key>)


@dataclass
class Line:
    d: str                           # SVG path
    label: str
    cls: str                         # colour class in the page


@dataclass
class Mark:
    x: float
    label: str
    cls: str
    anchor: str = "start"            # where its label sits: right of the line ("start") or left of it ("end")
    y: float = _FIRST_ROW            # the label's baseline: one row per label that would overlap another


@dataclass
class Plot:
    key: str
    title: str
    unit: str
    lines: list[Line] = field(default_factory=list)
    y_ticks: list[tuple[float, str]] = field(default_factory=list)
    x_ticks: list[tuple[float, str]] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    width: int = PLOT_W
    height: int = PLOT_H
    empty: str = ""                  # why there is nothing to draw


@dataclass
class SoakView:
    figures: list[Figure]
    plots: list[Plot]
    details: list[tuple[str, str]]
    title: str = "Soak results"      # the section's heading: a soak's, or what a watch saw


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.1f} ms"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.0%}"


def figures(s: SoakStats) -> list[Figure]:
    """The soak's headline figures, each with its unit."""
    active = s.duration_s + (s.drain_s or 0.0)
    rate = s.tokens / active if active else 0.0
    failed = s.requests_failed + s.requests_timed_out
    requests = f"{s.requests_ok:,} ok · {failed:,} failed"
    pending = ""
    if s.in_flight_at_end:
        pending = (f"{s.in_flight_at_end} in flight at the stall" if s.stalled
                   else f"{s.in_flight_at_end} in flight when the load ended")
    if s.saturated is None:
        sat, sat_note = "not judged", "the server has no KV cache usage gauge"
    else:
        sat = "saturated" if s.saturated else f"not saturated ({s.bottleneck or '?'})"
        sat_note = (f"server ran {s.server_running_mean:.1f} of {s.streams_requested} streams on average"
                    if s.server_running_mean is not None and s.streams_requested else "")
    stall = (f"after {s.stall_after_s:.1f} s of load" if s.stalled and s.stall_after_s is not None
             else "stalled" if s.stalled else f"none in {s.duration_s:.1f} s")
    return [
        Figure("throughput", f"{rate:,.0f} tok/s", f"{s.tokens:,} tokens over {active:.1f} s", "throughput"),
        Figure("requests", requests, pending or f"{s.requests_sent:,} sent", "requests"),
        Figure("TTFT", f"p50 {_ms(s.ttft_p50_s)} · p99 {_ms(s.ttft_p99_s)}", "time to first token", "ttft"),
        Figure("ITL", f"p50 {_ms(s.itl_p50_s)} · p99 {_ms(s.itl_p99_s)}", "time between tokens", "itl"),
        Figure("KV cache peak", _pct(s.kv_usage_peak), "of the pool; saturated from 90 %", "kv"),
        Figure("saturation", sat, sat_note, "saturation"),
        Figure("stall", stall, "no token with requests in flight for the stall window" if s.stalled else "",
               "stall"),
    ]


def details(s: SoakStats) -> list[tuple[str, str]]:
    """The rest of the soak's facts, labelled, with units."""
    out = [("saturation", s.saturation_note)] if s.saturation_note else []
    out += [("time loaded", f"{s.duration_s:.1f} s" + (f" of {s.requested_duration_s:g} s requested"
                                                     if s.requested_duration_s is not None else ""))]
    if s.drain_s is not None:
        done = (s.drain_in_flight or 0) - (s.drain_cut or 0)
        out.append(("drain", f"{s.drain_s:.1f} s (grace {s.drain_grace_s or 0:g} s): {done} of "
                             f"{s.drain_in_flight or 0} in-flight request(s) finished, {s.drain_cut or 0} cancelled"))
    if s.streams_requested is not None:
        out.append(("streams", f"{s.streams_requested} requested, {s.streams_in_flight_mean or 0:.1f} kept in flight "
                               "on average by the client"))
    if s.server_running_mean is not None or s.server_running_peak is not None:
        out.append(("server ran", f"{s.server_running_mean or 0:.1f} requests on average (peak "
                                  f"{s.server_running_peak or 0:.0f}), up to {s.server_waiting_peak or 0:.0f} waiting"))
    if s.metrics_scrapes is not None:
        gap = "—" if s.metrics_longest_gap_s is None else f"{s.metrics_longest_gap_s:.1f} s"
        out.append(("/metrics", f"{s.metrics_scrapes} scrapes every {s.metrics_period_s or 0:g} s, "
                                f"{s.metrics_failures or 0} failed, longest gap {gap}"))
    cpu = [f"kvdiag's load loop {s.client_cpu:.0%} of a core" if s.client_cpu is not None else "",
           f"server {s.server_cpu:.2f} cores" if s.server_cpu is not None else "",
           f"machine {s.machine_cpu_busy:.0%} busy" if s.machine_cpu_busy is not None else ""]
    if any(cpu):
        out.append(("CPU", ", ".join(c for c in cpu if c)))
    return out


def _nice_max(v: float) -> float:
    """A round upper bound for an axis (1, 2, 2.5, 5 × 10^k)."""
    if v <= 0:
        return 1.0
    mag = 10.0 ** math.floor(math.log10(v))
    return next(step * mag for step in (1.0, 2.0, 2.5, 5.0, 10.0) if v <= step * mag * (1 + 1e-9))


def _plot(key: str, title: str, unit: str, series: Sequence[tuple[str, str, Sequence[tuple[float, float]]]],
          t0: float, t1: float, marks: Sequence[tuple[float, str, str]], y_max: float | None = None,
          fmt: str = "{:g}") -> Plot:
    plot = Plot(key=key, title=title, unit=unit)
    points = [p for _, _, pts in series for p in pts if t0 <= p[0] <= t1]
    if not points or t1 <= t0:
        plot.empty = "no samples"
        return plot
    top = y_max if y_max is not None else _nice_max(max(v for _, v in points))
    w, h = PLOT_W - _LEFT - _RIGHT, PLOT_H - _TOP - _BOTTOM

    def x(t: float) -> float:
        return _LEFT + (t - t0) / (t1 - t0) * w

    def y(v: float) -> float:
        return _TOP + h - max(0.0, min(v, top)) / top * h

    for label, cls, pts in series:
        # A point outside the span (an engine's start-up before the load) would be drawn over the axis labels.
        pts = [(t, v) for t, v in pts if t0 <= t <= t1]
        if pts:
            d = " ".join(f"{'M' if i == 0 else 'L'} {x(t):.1f} {y(v):.1f}" for i, (t, v) in enumerate(pts))
            plot.lines.append(Line(d=d, label=label, cls=cls))
    plot.y_ticks = [(y(v), fmt.format(v)) for v in (0.0, top / 2, top)]
    # The x axis counts seconds from ``t0`` (the load's start): the engine's start-up is not plotted.
    span = t1 - t0
    step = next((s for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600) if span / s <= 6), 1200)
    plot.x_ticks = [(x(t0 + k), f"{k:g} s") for k in range(0, int(span) + 1, step)]
    plot.marks = _placed([Mark(x=x(t), label=label, cls=cls) for t, label, cls in marks if t0 <= t <= t1])
    return plot


def _placed(marks: list[Mark]) -> list[Mark]:
    """Each mark's label put beside its line where it overlaps no other label: right of the line, else left,
    in the first row where it fits (the last row when none does), never past the plot's edges."""
    rows: list[list[tuple[float, float]]] = [[] for _ in range(_ROWS)]
    lo, hi = _LEFT, PLOT_W - _RIGHT
    for m in sorted(marks, key=lambda m: m.x):
        w = len(m.label) * _CHAR_W
        sides = [("start", m.x + 3, m.x + 3 + w), ("end", m.x - 3 - w, m.x - 3)]
        sides = [s for s in sides if s[1] >= lo - 3 and s[2] <= hi] or [min(
            sides, key=lambda s: max(lo - s[1], s[2] - hi))]
        spot = next(((row, side) for row in range(_ROWS) for side in sides
                     if all(side[2] + 4 <= a or b + 4 <= side[1] for a, b in rows[row])), (_ROWS - 1, sides[0]))
        row, (m.anchor, left, right) = spot
        rows[row].append((left, right))
        m.y = _FIRST_ROW + _ROW_H * row
    return marks


def _gauge(metrics: Sequence[MetricsSnapshot], attr: str, scale: float = 1.0) -> list[tuple[float, float]]:
    return [(m.t, float(getattr(m, attr)) * scale) for m in metrics if getattr(m, attr) is not None]


def _marks(timeline: Sequence[TimelineEvent]) -> list[tuple[float, str, str]]:
    names = {"soak load started": ("load started", "plain"), "stall onset (last progress)": ("last token", "warn"),
             "last progress": ("last progress", "warn"),
             "stall detected": ("stall detected", "bad"), "soak duration reached": ("duration reached", "plain")}
    return [(e.t, *names[e.event]) for e in timeline if e.event in names]


def soak_lines(s: SoakStats, stall_to_verdict_s: float | None = None) -> list[str]:
    """The soak's summary lines: load, time loaded and drain, scrapes, saturation, stall → verdict."""
    active = s.duration_s + (s.drain_s or 0.0)
    rate = s.tokens / active if active else 0.0

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f} ms"

    pending = ""
    if s.stalled and s.in_flight_at_end:
        pending = f", {s.in_flight_at_end} in flight at the stall"
    elif s.in_flight_at_end and s.drain_s is None:
        pending = f", {s.in_flight_at_end} in flight when the load ended"
    out = [f"load: {s.requests_ok} requests ok, {s.requests_failed} failed, {s.requests_timed_out} timed out"
           f"{pending}; "
           # An average over the whole load (ramp-up and drain included); the live lines' rate is over their
           # last 5 s, so a steady live rate above this average is not a contradiction: both are labelled.
           f"{s.tokens} tokens, avg {rate:.0f} tok/s over {active:.1f} s; TTFT p50 {ms(s.ttft_p50_s)} "
           f"p99 {ms(s.ttft_p99_s)}; "
           f"ITL p50 {ms(s.itl_p50_s)} p99 {ms(s.itl_p99_s)}"]
    asked = f" of {s.requested_duration_s:g} s requested" if s.requested_duration_s is not None else ""
    line = f"time loaded: {s.duration_s:.1f} s{asked}"
    if s.drain_s is not None:
        done = (s.drain_in_flight or 0) - (s.drain_cut or 0)
        line += (f"; drain {s.drain_s:.1f} s (grace {s.drain_grace_s or 0:g} s): {done} of {s.drain_in_flight or 0} "
                 f"in-flight request(s) finished, {s.drain_cut or 0} cancelled")
    out.append(line)
    if s.metrics_scrapes is not None:
        gap = "-" if s.metrics_longest_gap_s is None else f"{s.metrics_longest_gap_s:.1f} s"
        out.append(f"metrics: {s.metrics_scrapes} scrapes every {s.metrics_period_s or 0:g} s, "
                   f"{s.metrics_failures or 0} failed, longest gap {gap}")
    if s.saturation_note:
        out.append(f"saturation: {s.saturation_note}")
    if stall_to_verdict_s is not None:
        out.append(f"stall detected → verdict: {stall_to_verdict_s:.1f} s")
    return out


def soak_view(report: Report, bundle: Bundle | None) -> SoakView | None:
    """The soak section of a report, or None for a run that is not a soak."""
    s = report.soak
    if s is None:
        return None
    metrics = sorted(bundle.metrics, key=lambda m: m.t) if bundle is not None else []
    times = [p.t for p in s.series] + [m.t for m in metrics]
    marks = _marks(report.timeline)
    start = next((t for t, label, _ in marks if label == "load started"), None)
    t0 = start if start is not None else (min(times) if times else 0.0)
    t1 = max([t for t in times if t >= t0] + [t for t, _, _ in marks], default=t0)
    rate = [(p.t, p.tokens_per_s) for p in s.series if p.tokens_per_s is not None and p.t >= t0]
    in_flight = [(p.t, float(p.in_flight)) for p in s.series if p.t >= t0]
    plots = [
        _plot("tokens", "tokens per second (client)", "tok/s", [("tokens/s", "ok", rate)], t0, t1, marks),
        _plot("kv", "KV cache usage (server)", "% of pool",
              [("KV usage", "info", _gauge(metrics, "kv_cache_usage", 100.0))], t0, t1, marks, y_max=100.0,
              fmt="{:.0f} %"),
        _plot("requests", "requests", "requests",
              [("running (server)", "ok", _gauge(metrics, "running")),
               ("waiting (server)", "warn", _gauge(metrics, "waiting")),
               ("in flight (client)", "plain", in_flight)], t0, t1, marks),
    ]
    for p in plots:
        if p.empty and p.key != "tokens":
            p.empty = "the server's /metrics gave no samples" if not metrics else "no samples"
    return SoakView(figures=figures(s), plots=plots, details=details(s))


def _counter_rate(metrics: Sequence[MetricsSnapshot], attr: str) -> list[tuple[float, float]]:
    """A counter's rate between consecutive snapshots, placed at the later one (a restart's drop is 0)."""
    pts = [(m.t, float(getattr(m, attr))) for m in metrics if getattr(m, attr) is not None]
    return [(t1, max(0.0, v1 - v0) / (t1 - t0))
            for (t0, v0), (t1, v1) in zip(pts, pts[1:], strict=False) if t1 > t0]


def watch_view(report: Report, bundle: Bundle | None) -> SoakView | None:
    """What `kvdiag watch` read of a stalled server's /metrics before it captured it, plotted as a soak's
    measurements are (the server's tokens per second, KV usage, requests running and waiting), with
    the last progress and the stall marked. None for a report without such a record."""
    if report.soak is not None or bundle is None or len(bundle.metrics) < 2:
        return None
    if not any(e.event == "stall detected" for e in report.timeline):
        return None
    metrics = sorted(bundle.metrics, key=lambda m: m.t)
    marks = _marks(report.timeline)
    t0 = metrics[0].t
    t1 = max([metrics[-1].t] + [t for t, _, _ in marks])
    plots = [
        _plot("tokens", "tokens per second (server)", "tok/s",
              [("tokens/s", "ok", _counter_rate(metrics, "generation_tokens"))], t0, t1, marks),
        _plot("kv", "KV cache usage (server)", "% of pool",
              [("KV usage", "info", _gauge(metrics, "kv_cache_usage", 100.0))], t0, t1, marks, y_max=100.0,
              fmt="{:.0f} %"),
        _plot("requests", "requests (server)", "requests",
              [("running", "ok", _gauge(metrics, "running")), ("waiting", "warn", _gauge(metrics, "waiting"))],
              t0, t1, marks),
    ]
    span = metrics[-1].t - metrics[0].t
    figures = [Figure(label="watched", value=f"{span:.0f} s", note=f"{len(metrics)} /metrics samples", key="span")]
    return SoakView(figures=figures, plots=plots, details=[], title="What the watch saw")


__all__ = ["Figure", "Plot", "SoakView", "figures", "soak_lines", "soak_view", "watch_view"]
