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
    """One judgement of a PageAllocator banner, read by `kvdiag banner`, `doctor` and every report."""

    risky: bool                      # the banner predicts the hang at start-up
    pages_per_layer: int
    reasons: list[str] = Field(default_factory=list)
    load_risk: str | None = None     # the hang it leaves open once load fills the pool; None: none (prealloc off,
                                     # or the engine runs an allocator that waits without the GIL)

    @property
    def at_risk(self) -> bool:
        """A hang is predicted, at start-up or under load."""
        return self.risky or self.load_risk is not None

    @property
    def label(self) -> str:
        """The words a report shows for this judgement."""
        if self.risky:
            return "RISK at start-up"
        return "RISK under load" if self.load_risk is not None else "ok"


class TimelineEvent(_Model):
    t: float
    event: str
    engine: str | None = None
    detail: str | None = None


class MetricsSnapshot(_Model):
    """One scrape of an engine's vLLM /metrics, each metric summed over its label sets; None: the server
    exports no such metric."""

    t: float = Field(description="When it was read: seconds on the run's clock (the timeline's).")
    engine: str | None = Field(
        None, description="The engine it was read from; None: not named (it counts for every engine).")
    kv_cache_usage: float | None = Field(
        None, description="vllm:kv_cache_usage_perc (older vLLM: gpu_cache_usage_perc), 0..1: the KV pool in use.")
    running: float | None = Field(None, description="vllm:num_requests_running: requests the scheduler runs.")
    waiting: float | None = Field(None, description="vllm:num_requests_waiting: requests queued, not yet scheduled.")
    preemptions: float | None = Field(
        None, description="vllm:num_preemptions_total: requests preempted since the server started.")
    generation_tokens: float | None = Field(
        None, description="vllm:generation_tokens_total: tokens generated since the server started.")
    prompt_tokens: float | None = Field(
        None, description="vllm:prompt_tokens_total: prompt tokens prefilled since the server started.")


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
    """What `kvdiag soak` measured: the client's requests and latencies, how the load phase ended, the /metrics
    scrapes, and whether the load filled the KV pool."""

    requests_sent: int = Field(
        0, description="Streaming requests the client started; those not ok, failed or timed out were cancelled.")
    requests_ok: int = 0
    requests_failed: int = Field(
        0, description="Requests ended by an HTTP error status, a refused or cut connection, malformed SSE or an "
                       "error event.")
    requests_timed_out: int = 0
    tokens: int = Field(0, description="Tokens the client received (a stream's usage count where it reported more).")
    duration_s: float = Field(
        0.0, description="Seconds the load actually ran (to --duration, a stall or an exit), the drain not included.")
    ttft_p50_s: float | None = Field(
        None, description="Time to first token, seconds from the request's write, median; None: no token came.")
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    stalled: bool = False
    stall_after_s: float | None = Field(
        None, description="Seconds from the start of the load to the stall's onset (the last progress).")
    # How the load phase ended, as the soak judgement (analyze) reads it.
    server_unreachable: bool = Field(False, description="An external server stopped answering during the load.")
    all_requests_failed: bool = Field(False, description="Not one request succeeded: the soak tested nothing.")
    # The load phase: loaded for duration_s, then the drain.
    requested_duration_s: float | None = Field(None, description="The load's duration as asked (--duration).")
    drain_s: float | None = Field(None, description="Seconds the drain took.")
    drain_grace_s: float | None = Field(
        None, description="Seconds the requests in flight when the load ended got to finish (--drain-grace).")
    drain_in_flight: int | None = Field(None, description="Requests in flight when the drain began.")
    drain_cut: int | None = Field(None, description="Requests still in flight when the drain ended, cancelled.")
    # /metrics scrapes (own thread and timer).
    metrics_period_s: float | None = None
    metrics_scrapes: int | None = None
    metrics_failures: int | None = None
    metrics_longest_gap_s: float | None = Field(None, description="Longest time between two snapshots, seconds.")
    # Saturation: did the KV pool get near full, and if not, which side held the load back.
    saturated: bool | None = Field(
        None, description="KV cache usage reached the KV-full threshold; None: no usable KV usage gauge to judge from.")
    kv_usage_peak: float | None = None
    streams_requested: int | None = None
    streams_in_flight_mean: float | None = Field(None, description="Requests the client kept in flight, mean.")
    server_running_peak: float | None = None
    server_running_mean: float | None = None
    server_waiting_peak: float | None = None
    client_cpu: float | None = Field(None, description="kvdiag's load loop, share of one core.")
    server_cpu: float | None = Field(None, description="The server's processes, cores.")
    machine_cpu_busy: float | None = Field(None, description="All CPUs, 0..1.")
    bottleneck: str | None = Field(
        None, description='Which side held the load back: "client", "server" or "load"; only when not saturated.')
    saturation_note: str | None = None
    # The loaded time on the run's clock: the /metrics snapshots analyze judges saturation from (with the
    # readings above); None in bundles whose run judged it itself (their judgement is kept as stored).
    load_from_t: float | None = None
    load_until_t: float | None = None
    in_flight_at_end: int | None = Field(
        None, description="Requests still in flight when the load ended (at the stall, an exit, the end of the drain).")
    series: list[SoakSample] = Field(
        default_factory=list,
        description="The client's counters over time (about two a second), for the report's plots; [] in older "
                    "bundles.")


class Finding(_Model):
    """Something worth telling the user that is not itself the verdict."""

    kind: str                        # "tool_missing", "banner_risk", "tool_failed", ...
    message: str
    pid: int | None = None
    engine: str | None = None
    node: str | None = None          # the host ``pid`` lives on, in a bundle merged from several hosts
