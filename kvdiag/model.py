"""The typed model that flows between pipeline stages.

Capture produces a :class:`Bundle`; analyzers read a bundle and return a
:class:`Verdict`; reporters render a :class:`Report` (bundle + verdict). Every
model here round-trips through JSON (``model_dump(mode="json")`` /
``model_validate``) so a bundle attached to someone else's bug can be
re-analyzed offline.

Conventions:
- frames are listed innermost first (index 0 is the frame executing now), like
  gdb and py-spy; pystack's outermost-first order is reversed on parse;
- times in the timeline are seconds since the run started (monotonic);
- paths inside a bundle are relative to the bundle folder.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = "1"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class VerdictKind(str, Enum):
    HEALTHY = "healthy"
    SLOW_START = "slow_start"
    GIL_CYCLE = "gil_cycle"
    LOCK_ORDER_INVERSION = "lock_order_inversion"
    LOST_WAKEUP = "lost_wakeup"
    BLOCKED_IPC_READ = "blocked_ipc_read"
    DECODE_STALL = "decode_stall"
    CRASH = "crash"
    OOM = "oom"
    UNKNOWN = "unknown"
    NOT_SATURATED = "not_saturated"   # a soak with no hang that never filled the KV pool: inconclusive

    @property
    def is_hang(self) -> bool:
        return self in _HANG_KINDS


_HANG_KINDS = frozenset({
    VerdictKind.GIL_CYCLE, VerdictKind.LOCK_ORDER_INVERSION, VerdictKind.LOST_WAKEUP,
    VerdictKind.BLOCKED_IPC_READ, VerdictKind.DECODE_STALL, VerdictKind.UNKNOWN,
})


class Confidence(str, Enum):
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


class EnginePhase(str, Enum):
    """Startup phases as the log shows them, in order."""

    NOT_STARTED = "not_started"
    LAUNCHING = "launching"
    LOADING = "loading"
    PROFILING = "profiling"
    KV_INIT = "kv_init"
    BANNER = "banner"          # the `Init C++ PageAllocator` banner was printed
    SERVING = "serving"        # `Application startup complete.` and /health 200
    STALLED = "stalled"
    EXITED = "exited"


class ProcessRole(str, Enum):
    API_SERVER = "api_server"
    ENGINE_CORE = "engine_core"
    WORKER = "worker"
    OTHER = "other"


class ThreadState(str, Enum):
    RUNNING = "running"        # R
    SLEEPING = "sleeping"      # S
    DISK_SLEEP = "disk_sleep"  # D
    STOPPED = "stopped"        # T / t
    ZOMBIE = "zombie"          # Z / X
    UNKNOWN = "unknown"


class GilState(str, Enum):
    HOLDS = "holds"            # pystack: [Has the GIL]
    WAITING = "waiting"        # pystack flag, or inferred from frames / futex address
    NONE = "none"              # known not to hold or wait
    UNKNOWN = "unknown"


class Frame(_Model):
    """One stack frame. ``kind`` tells Python frames from native ones."""

    name: str
    kind: Literal["python", "native"] = "native"
    file: str | None = None
    line: int | None = None
    library: str | None = None      # shared object for native frames
    source: str | None = None       # the source line pystack prints under Python frames


class ToolRun(_Model):
    """What one capture backend did for one process."""

    tool: str                        # "pystack", "py-spy", "gdb", "proc"
    ok: bool
    duration_s: float = 0.0
    error: str | None = None         # one line: "gdb not installed", "timed out after 10s", ...
    raw_path: str | None = None      # raw output file, relative to the bundle folder
    command: list[str] = Field(default_factory=list)


class ThreadEvidence(_Model):
    tid: int
    name: str | None = None
    state: ThreadState = ThreadState.UNKNOWN
    wchan: str | None = None
    kernel_stack: list[str] = Field(default_factory=list)
    syscall: str | None = None       # raw /proc/<pid>/task/<tid>/syscall
    syscall_nr: int | None = None
    futex_addr: int | None = None    # first syscall argument when blocked in futex(2)
    gil: GilState = GilState.UNKNOWN
    in_gil_struct: bool | None = None   # futex address lies in the interpreter's GIL (via _PyRuntime)
    futex_owner_tid: int | None = None  # owner TID of the mutex this thread's futex wait is on (read-only mem read)
    utime_ticks: int | None = None
    stime_ticks: int | None = None
    cpu_ticks_delta: int | None = None  # over the capture's CPU sampling interval
    frames: list[Frame] = Field(default_factory=list)      # best merged stack, innermost first
    frames_by_tool: dict[str, list[Frame]] = Field(default_factory=dict)
    gil_by_tool: dict[str, GilState] = Field(default_factory=dict)   # each source's own GIL reading


class ProcessEvidence(_Model):
    pid: int
    ppid: int | None = None
    pgid: int | None = None
    comm: str | None = None
    cmdline: list[str] = Field(default_factory=list)
    role: ProcessRole = ProcessRole.OTHER
    engine: str | None = None        # scenario engine name this process belongs to
    state: ThreadState = ThreadState.UNKNOWN
    wchan: str | None = None
    exe: str | None = None
    python_version: str | None = None
    cpu_percent: float | None = None
    alive: bool = True
    threads: list[ThreadEvidence] = Field(default_factory=list)
    tools: list[ToolRun] = Field(default_factory=list)
    gil_futex_range: tuple[int, int] | None = None   # [start, end) address of the GIL struct


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


class Finding(_Model):
    """Something worth telling the user that is not itself the verdict."""

    kind: str                        # "tool_missing", "banner_risk", "tool_failed", ...
    message: str
    pid: int | None = None
    engine: str | None = None


class Bundle(_Model):
    """Everything one run captured. Written as bundle/bundle.json."""

    schema_version: str = SCHEMA_VERSION
    kvdiag_version: str = ""
    command: str = ""
    created_at: str = ""             # ISO-8601 UTC
    host: dict[str, str] = Field(default_factory=dict)
    scenario: dict[str, object] | None = None
    scenario_path: str | None = None
    stall_window_s: float | None = None
    engines: list[EngineRecord] = Field(default_factory=list)
    processes: list[ProcessEvidence] = Field(default_factory=list)
    timeline: list[TimelineEvent] = Field(default_factory=list)
    metrics: list[MetricsSnapshot] = Field(default_factory=list)
    soak: SoakStats | None = None
    findings: list[Finding] = Field(default_factory=list)
    stall_detected: bool = False     # the watcher saw no progress for the stall window
    interrupted: bool = False
    stall_to_verdict_s: float | None = None   # "stall detected" → verdict, seconds (capture, analysis)


class EvidenceItem(_Model):
    pid: int
    tid: int
    role: str                        # "alloc_page caller (holds GIL)", "prealloc worker (waits for GIL)"
    frames: list[str] = Field(default_factory=list)
    engine: str | None = None


class Verdict(_Model):
    kind: VerdictKind
    summary: str
    confidence: Confidence = Confidence.MEDIUM
    evidence: list[EvidenceItem] = Field(default_factory=list)
    engine: str | None = None
    cycle: list[str] = Field(default_factory=list)   # node labels of the wait-for cycle, in order
    findings: list[Finding] = Field(default_factory=list)


class Report(_Model):
    """report.json. Field names here are the user-facing contract."""

    schema_version: str = SCHEMA_VERSION
    kvdiag_version: str = ""
    command: str = ""
    created_at: str = ""
    exit_code: int = 0
    verdict: Verdict
    verdicts_by_engine: dict[str, Verdict] = Field(default_factory=dict)
    engines: list[dict[str, object]] = Field(default_factory=list)
    timeline: list[TimelineEvent] = Field(default_factory=list)
    findings: list[Finding] = Field(default_factory=list)
    soak: SoakStats | None = None
    ab: dict[str, object] | None = None
    bundle_path: str | None = None
    # Added by the report stage: environment and run context for the human reader.
    host: dict[str, str] = Field(default_factory=dict)
    scenario: str | None = None      # scenario name or path the run used
    stall_window_s: float | None = None
    interrupted: bool = False        # the run was cut short; the report holds what it got
    stall_to_verdict_s: float | None = None   # "stall detected" → verdict, seconds
