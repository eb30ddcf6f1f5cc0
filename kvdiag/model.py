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
    # No evidence is not health (issue 21): outcomes that say why nothing could be judged.
    NO_ACCESS = "no_access"            # ptrace / /proc/PID/mem refused: the fix is named (exit 3)
    EXITED = "exited"                  # the target exited before or during capture (exit 6)
    ZOMBIE = "zombie"                  # exited, not reaped by its parent: nothing runs (exit 6)
    NOT_PYTHON = "not_python"          # no Python interpreter in the target (exit 6)
    KERNEL_THREAD = "kernel_thread"    # a kernel thread (kthreadd, pid 2, and its children): refused (exit 6)

    @property
    def is_hang(self) -> bool:
        return self in _HANG_KINDS


_HANG_KINDS = frozenset({
    VerdictKind.GIL_CYCLE, VerdictKind.LOCK_ORDER_INVERSION, VerdictKind.LOST_WAKEUP,
    VerdictKind.BLOCKED_IPC_READ, VerdictKind.DECODE_STALL, VerdictKind.UNKNOWN,
})


# Outcomes that say the evidence a verdict needs could not be had; never healthy, never a hang.
NO_EVIDENCE_KINDS = frozenset({
    VerdictKind.NO_ACCESS, VerdictKind.EXITED, VerdictKind.ZOMBIE, VerdictKind.NOT_PYTHON,
    VerdictKind.KERNEL_THREAD,
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
    redactions: dict[str, int] = Field(default_factory=dict)   # secrets removed from what it read, per kind


class RedactionSummary(_Model):
    """What the redactor removed before anything was written: kinds and counts, never values."""

    total: int = 0
    by_kind: dict[str, int] = Field(default_factory=dict)      # "secret_flag", "github", "url_userinfo", ...
    files: dict[str, dict[str, int]] = Field(default_factory=dict)  # bundle-relative path -> kind -> count


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


class TargetAccess(_Model):
    """What the preflight (kvdiag.capture.access) found about reading one process, before attaching."""

    uid: int | None = None           # the target's real uid (None: could not read /proc/PID/status)
    our_uid: int | None = None
    ptrace_ok: bool = True           # /proc/PID/mem opened: ptrace-based tools may attach and read
    refused: list[str] = Field(default_factory=list)   # what was refused and why, one line each
    fixes: list[str] = Field(default_factory=list)     # the fixes that fit, most direct first
    kernel_thread: bool = False
    zombie: bool = False
    exit_status: str | None = None   # "exit code 3", "killed by SIGKILL" when known (zombie)
    python: bool | None = None       # a Python interpreter is in the process; None: could not tell
    ptrace_scope: int | None = None  # /proc/sys/kernel/yama/ptrace_scope (None: no Yama)
    cap_sys_ptrace: bool = False     # CAP_SYS_PTRACE in kvdiag's effective capabilities
    container: str | None = None     # "docker", "podman", "kubernetes", ... when kvdiag runs in one
    seccomp: int | None = None       # kvdiag's own seccomp mode (0 none, 1 strict, 2 filter)


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
    access: TargetAccess | None = None   # the preflight's findings; None: captured without one


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
    redaction: RedactionSummary = Field(default_factory=RedactionSummary)


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
    redaction: RedactionSummary = Field(default_factory=RedactionSummary)
