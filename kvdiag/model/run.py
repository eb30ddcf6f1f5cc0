"""What a run recorded of its engines: banners, timeline, metrics, soak figures, findings."""

from __future__ import annotations

from pydantic import Field

from kvdiag.model.kinds import EnginePhase, _Model
from kvdiag.model.soakseries import SoakSample


class BannerInfo(_Model):
    """One parsed `Init C++ PageAllocator: ...` line."""

    num_layers: int
    mem_size_per_layer_mb: int
    total_mem_size_mb: int
    page_size_mb: int
    world_size: int
    pp_rank: int
    async_sched: bool
    contiguous_layout: bool
    enable_prealloc: bool
    num_kv_buffers: int
    group_id: int
    min_reserved_pages: int
    max_reserved_pages: int
    raw: str = ""
    line_no: int | None = None
    source: str | None = None        # log file or engine name


class BannerRisk(_Model):
    risky: bool
    pages_per_layer: int
    reasons: list[str] = Field(default_factory=list)


class TimelineEvent(_Model):
    t: float
    event: str
    engine: str | None = None
    detail: str | None = None


class MetricsSnapshot(_Model):
    t: float
    engine: str | None = None
    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None


class EngineRecord(_Model):
    name: str
    allocator: str | None = None     # stock | fixed | external
    phase: EnginePhase = EnginePhase.NOT_STARTED
    url: str | None = None
    healthy: bool = False
    exit_code: int | None = None
    log_path: str | None = None      # relative to the bundle folder
    log_tail: list[str] = Field(default_factory=list)
    last_log_line: str | None = None
    banners: list[BannerInfo] = Field(default_factory=list)
    pids: dict[str, int] = Field(default_factory=dict)  # "api_server", "engine_core", "worker"
    startup_s: float | None = None
    error: str | None = None         # crash / OOM text seen in the log
    log_idle_s: float | None = None  # seconds since the log was last written, when a bare process was captured
    # The scenario's engine kind: "sim" (kvdiag's simulated engine), "vllm" or "command"; None when not
    # recorded (the bundle's scenario copy says).
    kind: str | None = None


class SoakStats(_Model):
    requests_sent: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    requests_timed_out: int = 0
    tokens: int = 0
    duration_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    stalled: bool = False
    stall_after_s: float | None = None
    # How the load phase ended, as the soak judgement (analyze) reads it.
    server_unreachable: bool = False  # an external server stopped answering during the load
    all_requests_failed: bool = False  # not one request succeeded: the soak tested nothing
    # The load phase: duration_s is the time actually loaded; then requests in flight got up to
    # drain_grace_s to finish (drain_s it took; drain_cut still in flight at its end, cancelled).
    requested_duration_s: float | None = None
    drain_s: float | None = None
    drain_grace_s: float | None = None
    drain_in_flight: int | None = None
    drain_cut: int | None = None
    # /metrics scrapes (own thread and timer): count, failures, longest time between two snapshots.
    metrics_period_s: float | None = None
    metrics_scrapes: int | None = None
    metrics_failures: int | None = None
    metrics_longest_gap_s: float | None = None
    # Saturation: did the KV pool get near full, and if not, which side held the load back.
    saturated: bool | None = None            # None: no KV usage gauge to judge from
    kv_usage_peak: float | None = None
    streams_requested: int | None = None
    streams_in_flight_mean: float | None = None   # client side
    server_running_peak: float | None = None
    server_running_mean: float | None = None
    server_waiting_peak: float | None = None
    client_cpu: float | None = None          # kvdiag's load loop, share of one core
    server_cpu: float | None = None          # the server's processes, cores
    machine_cpu_busy: float | None = None    # all CPUs, 0..1
    bottleneck: str | None = None            # "client", "server", "load" (only when not saturated)
    saturation_note: str | None = None
    # The loaded time on the run's clock: the /metrics snapshots analyze judges saturation from (with the
    # readings above); None in bundles whose run judged it itself (their judgement is kept as stored).
    load_from_t: float | None = None
    load_until_t: float | None = None
    # Requests still in flight when the load ended (at the stall, an exit, the end of the drain).
    in_flight_at_end: int | None = None
    # The client's counters over time (about two a second), for the report's plots; [] in older bundles.
    series: list[SoakSample] = Field(default_factory=list)


class Finding(_Model):
    """Something worth telling the user that is not itself the verdict."""

    kind: str                        # "tool_missing", "banner_risk", "tool_failed", ...
    message: str
    pid: int | None = None
    engine: str | None = None
    node: str | None = None          # the host ``pid`` lives on, in a bundle merged from several hosts
