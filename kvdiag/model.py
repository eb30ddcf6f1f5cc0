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

from dataclasses import dataclass
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvdiag.errors import ExitCode

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
    # A thread holds the GIL while blocked in native code (sleep, read, wait) and Python threads
    # queue behind it: the process stalls for as long as that call lasts (no cycle needed).
    GIL_HELD_BLOCKED = "gil_held_blocked"
    # The target was stopped (SIGSTOP, job control) or is held by another tracer when captured:
    # nothing it does can be judged; capture left it as found.
    STOPPED = "stopped"
    TRACED = "traced"
    # No evidence is not health (issue 21): outcomes that say why nothing could be judged.
    NO_ACCESS = "no_access"            # ptrace / /proc/PID/mem refused: the fix is named (exit 3)
    EXITED = "exited"                  # the target exited before or during capture (exit 5)
    ZOMBIE = "zombie"                  # exited, not reaped by its parent: nothing runs (exit 5)
    NOT_PYTHON = "not_python"          # no Python interpreter in the target (exit 5)
    KERNEL_THREAD = "kernel_thread"    # a kernel thread (kthreadd, pid 2, and its children): refused (exit 5)
    NO_EVIDENCE = "no_evidence"        # alive, but no tool could read a single thread (missing, failed) (exit 3)
    NOT_SATURATED = "not_saturated"   # a soak with no hang that never filled the KV pool: inconclusive
    # A wait that is a hang or plain idleness depending on evidence that could not be read (named in the
    # summary): e.g. a blocked read whose fd peers (/proc) are missing: an idle server and a client waiting
    # for a reply look the same in its stacks. Never a deadlock, never healthy (exit 6).
    INCONCLUSIVE = "inconclusive"

    @property
    def spec(self) -> KindSpec:
        """Everything about this kind in one place: outcome, exit code, rank and display class."""
        return KIND_SPECS[self]

    @property
    def is_hang(self) -> bool:
        return self.spec.outcome == "hang"

    @property
    def exit_code(self) -> int:
        return self.spec.exit_code


@dataclass(frozen=True)
class KindSpec:
    """One verdict kind's definition: adding a kind is one line in :data:`KIND_SPECS`."""

    outcome: Literal["healthy", "hang", "engine_failed", "target_state", "no_evidence", "inconclusive"]
    exit_code: int
    rank: int          # severity: lower is worse; the overall verdict is the worst engine's
    display: Literal["ok", "warn", "bad", "fail", "unk"]   # report colour class (HTML and terminal)


_K = VerdictKind
KIND_SPECS: dict[VerdictKind, KindSpec] = {
    _K.GIL_CYCLE: KindSpec("hang", ExitCode.DEADLOCK, 0, "bad"),
    _K.GIL_HELD_BLOCKED: KindSpec("hang", ExitCode.DEADLOCK, 1, "bad"),
    _K.LOCK_ORDER_INVERSION: KindSpec("hang", ExitCode.DEADLOCK, 2, "bad"),
    _K.LOST_WAKEUP: KindSpec("hang", ExitCode.DEADLOCK, 3, "bad"),
    _K.BLOCKED_IPC_READ: KindSpec("hang", ExitCode.DEADLOCK, 4, "bad"),
    _K.DECODE_STALL: KindSpec("hang", ExitCode.DEADLOCK, 5, "bad"),
    _K.OOM: KindSpec("engine_failed", ExitCode.ENGINE_FAILED, 6, "fail"),
    _K.CRASH: KindSpec("engine_failed", ExitCode.ENGINE_FAILED, 7, "fail"),
    _K.UNKNOWN: KindSpec("hang", ExitCode.DEADLOCK, 8, "unk"),
    _K.STOPPED: KindSpec("target_state", ExitCode.TARGET_STOPPED, 9, "warn"),
    _K.TRACED: KindSpec("target_state", ExitCode.TARGET_STOPPED, 10, "warn"),
    _K.NO_ACCESS: KindSpec("no_evidence", ExitCode.NO_ACCESS, 11, "warn"),
    _K.NO_EVIDENCE: KindSpec("no_evidence", ExitCode.NO_ACCESS, 12, "warn"),
    _K.EXITED: KindSpec("no_evidence", ExitCode.NOT_DIAGNOSABLE, 13, "unk"),
    _K.ZOMBIE: KindSpec("no_evidence", ExitCode.NOT_DIAGNOSABLE, 14, "unk"),
    _K.NOT_PYTHON: KindSpec("no_evidence", ExitCode.NOT_DIAGNOSABLE, 15, "unk"),
    _K.KERNEL_THREAD: KindSpec("no_evidence", ExitCode.NOT_DIAGNOSABLE, 16, "unk"),
    _K.INCONCLUSIVE: KindSpec("inconclusive", ExitCode.INCONCLUSIVE, 17, "unk"),
    _K.SLOW_START: KindSpec("inconclusive", ExitCode.OK, 18, "warn"),
    _K.NOT_SATURATED: KindSpec("inconclusive", ExitCode.NOT_SATURATED, 19, "warn"),
    _K.HEALTHY: KindSpec("healthy", ExitCode.OK, 20, "ok"),
}


_HANG_KINDS = frozenset(k for k, spec in KIND_SPECS.items() if spec.outcome == "hang")
# Outcomes about the target's state rather than its health: their own exit code, never 10.
TARGET_STATE_KINDS = frozenset(k for k, spec in KIND_SPECS.items() if spec.outcome == "target_state")
# Outcomes that say the evidence a verdict needs could not be had; never healthy, never a hang.
NO_EVIDENCE_KINDS = frozenset(k for k, spec in KIND_SPECS.items() if spec.outcome == "no_evidence")


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
    # Lock-typed locals of a Python frame (pystack-locals): name -> address of the threading.Lock/RLock.
    # Nothing else of a frame's locals is ever kept.
    locks: dict[str, int] = Field(default_factory=dict)


class ToolRun(_Model):
    """What one capture backend did for one process."""

    tool: str                        # "pystack", "py-spy", "gdb", "proc"
    ok: bool
    duration_s: float = 0.0
    error: str | None = None         # one line: "gdb not installed", "timed out after 10s", ...
    raw_path: str | None = None      # raw output file, relative to the bundle folder
    command: list[str] = Field(default_factory=list)
    redactions: dict[str, int] = Field(default_factory=dict)   # secrets removed from what it read, per kind
    started_s: float | None = None   # when it started, seconds after the capture began (None: not recorded)


class RedactionSummary(_Model):
    """What the redactor removed before anything was written: kinds and counts, never values."""

    total: int = 0
    by_kind: dict[str, int] = Field(default_factory=dict)      # "secret_flag", "github", "url_userinfo", ...
    files: dict[str, dict[str, int]] = Field(default_factory=dict)  # bundle-relative path -> kind -> count


class FdInfo(_Model):
    """One open file descriptor of a target, as /proc and sock_diag describe it (read-only)."""

    fd: int
    kind: Literal["socket", "pipe", "file", "anon", "other"] = "other"
    target: str = ""                 # readlink of /proc/PID/fd/N: "socket:[123]", "pipe:[9]", a path
    inode: int | None = None
    proto: str | None = None         # "unix", "tcp", "tcp6", "udp" for sockets
    listening: bool = False          # a listening socket: waits for new clients, not for a peer
    accepted: bool = False           # the server end of an accepted connection (waits for the next request)
    peer_inode: int | None = None
    peer_pids: list[int] = Field(default_factory=list)   # other processes holding the other end
    peer_comm: str | None = None
    address: str | None = None       # "127.0.0.1:5000 -> 127.0.0.1:41234", a unix path
    partial: str | None = None       # why peer_inode/peer_pids may be incomplete (capture deadline, netlink)


class ProgressSample(_Model):
    """What changed in the target over a short window before any tool paused it."""

    window_s: float = 0.0
    cpu_ticks: int = 0               # all threads, utime+stime
    io_delta: dict[str, int] = Field(default_factory=dict)     # /proc/PID/io: rchar, wchar, syscr, syscw
    log_growth: dict[str, int] = Field(default_factory=dict)   # log file path -> bytes written in the window
    gil_holders: list[int | None] = Field(default_factory=list)  # GIL holder TID at each sample (/proc mem)

    @property
    def advanced(self) -> bool:
        """The process wrote to its log or did I/O during the window."""
        return any(v > 0 for v in self.log_growth.values()) or any(
            self.io_delta.get(k, 0) > 0 for k in ("wchar", "syscw", "rchar", "syscr"))


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
    ctx_switches_delta: int | None = None  # voluntary + involuntary switches over the same interval
    wait_timeout_ms: int | None = None  # poll/epoll/select timeout argument; -1 waits forever
    blocked_fds: list[FdInfo] = Field(default_factory=list)   # the fd(s) a read/poll is blocked on
    frames: list[Frame] = Field(default_factory=list)      # best merged stack, innermost first
    frames_by_tool: dict[str, list[Frame]] = Field(default_factory=dict)
    gil_by_tool: dict[str, GilState] = Field(default_factory=dict)   # each source's own GIL reading


class TargetAccess(_Model):
    """What the preflight (kvdiag.capture.access) found about reading one process, before attaching."""

    uid: int | None = None           # the target's real uid (None: could not read /proc/PID/status)
    our_uid: int | None = None
    ptrace_ok: bool = True           # /proc/PID/mem opened: kvdiag may read the target's memory
    tracers_ok: bool = True          # py-spy, pystack and gdb (kvdiag's children) may attach too
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
    # The target as found, before anything attached (read by the preflight whichever backends run):
    # a stopped or traced target is never judged healthy, even when the /proc backend is missing.
    state: str | None = None         # /proc/PID/stat state letter: "S", "R", "T" (stopped), "t" (tracing stop)
    tracer_pid: int | None = None    # TracerPid (0: none)


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
    tracer_pid: int | None = None    # TracerPid when another debugger holds the process
    progress: ProgressSample | None = None
    log_files: list[str] = Field(default_factory=list)   # regular files on fd 1/2 (where it logs)
    signals_caught: list[int] | None = None   # SigCgt: signals with a handler installed (None: not read)


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


class Finding(_Model):
    """Something worth telling the user that is not itself the verdict."""

    kind: str                        # "tool_missing", "banner_risk", "tool_failed", ...
    message: str
    pid: int | None = None
    engine: str | None = None


class DefectStatus(str, Enum):
    """Whether an installed kvcached build carries a known upstream defect."""

    PRESENT = "present"
    FIXED = "fixed"
    NOT_APPLICABLE = "not_applicable"   # the code the defect lives in is not in this build
    UNKNOWN = "unknown"


class DefectCheck(_Model):
    """One known upstream defect, judged from the installed files (not the version number)."""

    defect: str                      # "gil_holding_alloc_page", "unbounded_ipc_read", "headroom_underflow"
    title: str
    status: DefectStatus = DefectStatus.UNKNOWN
    upstream: str = ""               # "kvcached #371, fixed by PR #422"
    evidence: list[str] = Field(default_factory=list)   # "csrc/torch_bindings.cpp: alloc_page bound without ..."


class KvcachedBuild(_Model):
    """Fingerprint of an installed (or given) kvcached tree."""

    installed: bool = False
    version: str | None = None       # what the package metadata says (not trusted for the defects)
    location: str | None = None      # the package folder
    git_commit: str | None = None    # from direct_url.json when pip installed it from git
    allocator: Literal["cpp", "python", "unknown"] = "unknown"
    sources: list[str] = Field(default_factory=list)    # what was read: "source", "binary", "python"
    checks: list[DefectCheck] = Field(default_factory=list)
    verdict: Literal["pre_fix", "fixed", "not_affected", "unknown", "absent"] = "absent"
    summary: str = ""


class GpuInfo(_Model):
    index: int
    name: str = ""
    total_mb: int | None = None
    free_mb: int | None = None


class PtraceAccess(_Model):
    """Can this user attach a tracer (py-spy, pystack, gdb) to its processes?"""

    yama_ptrace_scope: int | None = None     # /proc/sys/kernel/yama/ptrace_scope; None = no Yama
    cap_sys_ptrace: bool | None = None       # in the effective capability set
    uid: int | None = None
    container: str | None = None             # "docker", "kubernetes", "podman", "lxc", ... or None
    seccomp: int | None = None               # Seccomp: 0 off, 1 strict, 2 filter
    attach_children: bool | None = None      # a process this user started (capture of repro engines)
    attach_any_same_uid: bool | None = None  # an unrelated process of the same user (capture --pid)
    problem: str | None = None               # one line: why capture would be refused
    fix: str | None = None                   # what to change


class ShmSegment(_Model):
    """A kvcached memory-info segment in /dev/shm (three int64: total, used, prealloc)."""

    name: str
    total_bytes: int | None = None
    used_bytes: int | None = None
    prealloc_bytes: int | None = None
    pids: list[int] = Field(default_factory=list)    # processes that have it open or mapped


class IpcSocket(_Model):
    """A kvcached worker IPC socket (/tmp/kvcached-tp-*/w<rank>.sock) and the processes at each end."""

    path: str
    listener_pids: list[int] = Field(default_factory=list)
    peer_pids: list[int] = Field(default_factory=list)   # connected clients (an in-flight map/unmap call)
    stale: bool = False                                  # the file exists but nobody listens


class KvcachedRuntime(_Model):
    segments: list[ShmSegment] = Field(default_factory=list)
    sockets: list[IpcSocket] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class InterpreterPackages(_Model):
    """Package versions as one engine's Python sees them (a vLLM venv is not kvdiag's interpreter)."""

    who: str                         # "engine a, b" (a scenario's vllm engines) or "pid 1234" (capture --pid)
    python: str                      # the interpreter's path
    python_version: str | None = None
    packages: dict[str, str | None] = Field(default_factory=dict)   # None = absent
    source: str = ""                 # "asked the interpreter" or "read from site-packages"
    note: str = ""                   # why the interpreter could not be asked, when it could not
    engines: list[str] = Field(default_factory=list)   # the scenario engines that run this interpreter
    kvcached: KvcachedBuild | None = None   # the kvcached build this interpreter imports (None: not judged)


class EnvironmentRecord(_Model):
    """The machine a bundle was captured on: what a bug report needs to be reproducible."""

    os: str = ""
    kernel: str = ""
    machine: str = ""
    python: str = ""
    packages: dict[str, str | None] = Field(default_factory=dict)   # vllm, kvcached, torch, ... (None = absent)
    packages_python: str = ""        # whose versions `packages` are: kvdiag's own interpreter (its path)
    engine_packages: list[InterpreterPackages] = Field(default_factory=list)   # the engines' own interpreters
    cuda_driver: str | None = None
    cuda_runtime: str | None = None
    gpus: list[GpuInfo] = Field(default_factory=list)
    gpu_note: str = ""               # "no GPU: ...", or how the GPUs were read
    env: dict[str, str] = Field(default_factory=dict)    # KVCACHED_*/VLLM_*/... in effect (redacted)
    env_source: str = ""             # whose environment: "kvdiag" or "pid 1234" (a captured engine's)
    cpus: int | None = None          # CPUs this process may run on
    cpu_limit: float | None = None   # cgroup cpu.max quota in CPUs
    memory_limit_mb: int | None = None
    memory_total_mb: int | None = None
    ptrace: PtraceAccess = Field(default_factory=PtraceAccess)
    kvcached: KvcachedBuild = Field(default_factory=KvcachedBuild)
    kvcached_runtime: KvcachedRuntime | None = None
    errors: list[str] = Field(default_factory=list)      # what could not be read, one line each


class RiskStatus(str, Enum):
    RISK = "risk"            # a known hang risk applies: `kvdiag doctor` exits 10
    WARN = "warn"            # worth fixing, not a hang risk (e.g. capture would be refused)
    OK = "ok"
    UNKNOWN = "unknown"
    NOT_APPLICABLE = "n/a"


class DoctorCheck(_Model):
    """One known risk judged for one subject (the host, a GPU, a scenario engine, a log's banner)."""

    check: str                       # "prealloc_pool", "colocation", "prefix_build", "headroom", "page_vs_block"
    subject: str
    status: RiskStatus
    detail: str
    fix: str | None = None
    upstream: str | None = None      # "kvcached #371 (PR #422)"


class DoctorReport(_Model):
    """What `kvdiag doctor --json` prints."""

    schema_version: str = SCHEMA_VERSION
    kvdiag_version: str = ""
    scenario: str | None = None
    environment: EnvironmentRecord
    checks: list[DoctorCheck] = Field(default_factory=list)
    risky: bool = False
    exit_code: int = 0


class KnownDefect(_Model):
    """A verdict matched to a known upstream defect."""

    id: str                          # "kvcached#371"
    title: str
    fixed_by: str | None = None      # "PR #422 (666671b)"
    fixed_in: str | None = None      # first release with the fix: "0.1.6"
    workaround: str | None = None
    url: str | None = None
    match: Literal["signature", "pattern"] = "pattern"

    def text(self) -> str:
        """``kvcached#371 (...); fixed by PR #422, first in 0.1.6``."""
        text = f"{self.id} ({self.title})"
        if self.fixed_by:
            text += f"; fixed by {self.fixed_by}"
        if self.fixed_in:
            text += f", first in {self.fixed_in}"
        return text

    def line(self) -> str:
        """``known: kvcached#371 (...); fixed by PR #422, first in 0.1.6``."""
        return f"known: {self.text()}"


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
    interrupted_reason: str | None = None   # "interrupted (Ctrl-C)", "received SIGTERM", ...
    # Nested runs (``kvdiag ab``): label -> that run's bundle folder, relative to this bundle folder.
    runs: dict[str, str] = Field(default_factory=dict)
    # What analyze said about this bundle when the run wrote it; renderers read only this.
    diagnosis: Diagnosis | None = None
    environment: EnvironmentRecord | None = None   # the machine it ran on (kvdiag.environment)
    redaction: RedactionSummary = Field(default_factory=RedactionSummary)
    stall_to_verdict_s: float | None = None   # "stall detected" → verdict, seconds (capture, analysis)


class EvidenceItem(_Model):
    pid: int
    tid: int
    role: str                        # "alloc_page caller (holds GIL)", "prealloc worker (waits for GIL)"
    frames: list[str] = Field(default_factory=list)
    engine: str | None = None
    # Indices into ``frames`` of the frames the rule's conclusion rests on (the wait primitive, the
    # first project frame, ...), decided by the analyzer; renderers highlight only these. None: a
    # report written before the field existed (nothing is highlighted).
    key_frames: list[int] | None = None

    def is_key(self, index: int) -> bool:
        return self.key_frames is not None and index in self.key_frames


class Verdict(_Model):
    kind: VerdictKind
    summary: str
    confidence: Confidence = Confidence.MEDIUM
    evidence: list[EvidenceItem] = Field(default_factory=list)
    engine: str | None = None
    cycle: list[str] = Field(default_factory=list)   # node labels of the wait-for cycle, in order
    findings: list[Finding] = Field(default_factory=list)
    # A stable hash of the kind and the cited project frames (kvdiag.analyze.signature), and the
    # known upstream defect it matches.
    signature: str | None = None
    known: KnownDefect | None = None
    # What raised or lowered ``confidence`` ("+ /health answered", "- no stacks were captured"):
    # evidence only, never timing noise (issue 17 item 6).
    confidence_reasons: list[str] = Field(default_factory=list)


class ABEngine(_Model):
    """One engine of one A/B side (``ab.<side>.engines[name]`` in bundle.json and report.json)."""

    phase: EnginePhase = EnginePhase.NOT_STARTED
    healthy: bool = False            # its verdict is healthy (kvdiag.analyze.health)
    health: str = ""                 # the health line: "yes", "no (decode stall; /health still answered)"
    startup_s: float | None = None


class ABSide(_Model):
    """One side of an A/B run, as the comparison reads it from that side's bundle."""

    verdict: VerdictKind
    summary: str
    exit_code: int
    # The side's bundle folder, relative to the A/B bundle folder ("" in reports written before it was kept).
    bundle: str = ""
    report: str | None = None        # the side's report.html, relative to the A/B output folder
    engines: dict[str, ABEngine] = Field(default_factory=dict)


class ABComparison(_Model):
    stock: ABSide
    fixed: ABSide
    separated: bool                  # stock reproduced a hang and fixed is healthy


class Diagnosis(_Model):
    """analyze(bundle): everything the run concluded. Stored in the bundle; renderers read only this."""

    verdict: Verdict
    verdicts_by_engine: dict[str, Verdict] = Field(default_factory=dict)
    exit_code: int = 0
    ab: ABComparison | None = None
    notes: list[str] = Field(default_factory=list)   # how the run-level judgement changed the verdict


class EnginePids(BaseModel):
    """An engine's process ids by role, as report.json shows them: ``api_server`` and ``engine_core``
    always (null when unknown), any other role the log named ("worker") after them."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, int | None] = Field(init=False)

    api_server: int | None = None
    engine_core: int | None = None

    @classmethod
    def of(cls, pids: dict[str, int]) -> EnginePids:
        """From an engine record's ``pids`` (role -> pid)."""
        return cls.model_validate(dict(pids))

    def by_role(self) -> dict[str, int | None]:
        """Role -> pid, the two named roles first."""
        out: dict[str, int | None] = {"api_server": self.api_server, "engine_core": self.engine_core}
        out.update(self.__pydantic_extra__ or {})
        return out


class ReportBanner(BannerInfo):
    """One banner in ``report.engines[].banners``: the parsed line and its risk for that engine's allocator."""

    risk: BannerRisk


class ReportEngine(_Model):
    """One ``report.engines[]`` item: the engine record plus its banner risk, health line and own verdict."""

    name: str
    allocator: str | None = None     # stock | fixed | external
    phase: EnginePhase = EnginePhase.NOT_STARTED
    # Healthy means the engine's verdict is healthy (kvdiag.analyze.health): a stalled engine is not,
    # even when its /health still answers; what /health said is kept apart and named in the health line.
    healthy: bool = False
    health: str = ""                 # "yes", "no (decode stall; /health still answered)"
    health_note: str | None = None
    health_endpoint_ok: bool = False
    url: str | None = None
    exit_code: int | None = None
    pids: EnginePids = Field(default_factory=EnginePids)
    startup_s: float | None = None
    banner: BannerInfo | None = None           # the first banner the engine printed
    banners: list[ReportBanner] = Field(default_factory=list)
    banner_risk: BannerRisk | None = None      # all banners' risks combined; None without a banner
    last_log_line: str | None = None
    log_path: str | None = None
    log_tail: list[str] = Field(default_factory=list)
    error: str | None = None
    verdict: VerdictKind | None = None
    verdict_summary: str | None = None


class Report(_Model):
    """report.json. Field names here are the user-facing contract."""

    schema_version: str = SCHEMA_VERSION
    kvdiag_version: str = ""
    command: str = ""
    created_at: str = ""
    exit_code: int = 0
    verdict: Verdict
    verdicts_by_engine: dict[str, Verdict] = Field(default_factory=dict)
    engines: list[ReportEngine] = Field(default_factory=list)
    timeline: list[TimelineEvent] = Field(default_factory=list)
    findings: list[Finding] = Field(default_factory=list)
    soak: SoakStats | None = None
    ab: ABComparison | None = None   # `kvdiag ab`: both runs side by side (the bundle's diagnosis.ab)
    bundle_path: str | None = None
    # Added by the report stage: environment and run context for the human reader.
    host: dict[str, str] = Field(default_factory=dict)
    scenario: str | None = None      # scenario name or path the run used
    stall_window_s: float | None = None
    interrupted: bool = False        # the run was cut short; the report holds what it got
    environment: EnvironmentRecord | None = None
    redaction: RedactionSummary = Field(default_factory=RedactionSummary)
    stall_to_verdict_s: float | None = None   # "stall detected" → verdict, seconds


Bundle.model_rebuild()
