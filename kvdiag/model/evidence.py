"""What capture read of one process: threads, frames, fds, tool runs, access."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvdiag.model.gpu import GpuReadings
from kvdiag.model.kinds import GilState, ProcessRole, ThreadState, _Model
from kvdiag.model.ranks import RankIdentity
from kvdiag.model.rings import RingReading
from kvdiag.model.waits import PeerProcess, SharedMapping


class Frame(_Model):
    """One stack frame. ``kind`` tells Python frames from native ones."""

    name: str
    kind: Literal["python", "native"] = "native"
    file: str | None = None
    line: int | None = None
    library: str | None = None      # shared object for native frames
    source: str | None = None       # the source line pystack prints under Python frames
    # Lock-typed locals of a Python frame (pystack-locals): name -> address of the threading.Lock/RLock.
    locks: dict[str, int] = Field(default_factory=dict)
    # Integer locals that count a loop's steps (``step``, ``seq``, ...: kvdiag.capture.parsers.STEP_LOCALS),
    # read by py-spy --locals for a rank of a distributed job: name -> value. Nothing else of a frame's
    # locals is ever kept.
    counters: dict[str, int] = Field(default_factory=dict)


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
    # Not run on purpose (``error`` says why: gdb where pystack already read the native frames, a zombie,
    # a kernel thread, a process without Python): neither a result nor a failure. Older bundles: False.
    skipped: bool = False

    @property
    def state(self) -> str:
        """``ok``, ``skipped`` or ``failed``: what every tool table shows."""
        return "ok" if self.ok else "skipped" if self.skipped else "failed"


class RedactionSummary(_Model):
    """What the redactor removed before anything was written: kinds and counts, never values."""

    total: int = 0
    by_kind: dict[str, int] = Field(default_factory=dict)      # "secret_flag", "github", "url_userinfo", ...
    files: dict[str, dict[str, int]] = Field(default_factory=dict)  # bundle-relative path -> kind -> count


class FdInfo(_Model):
    """One open file descriptor of a target, as /proc and sock_diag describe it (read-only)."""

    fd: int
    kind: Literal["socket", "pipe", "mqueue", "file", "anon", "other"] = "other"
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
    # A pipe's (or POSIX message queue's) other processes by the end they hold (fdinfo flags); None: not read.
    reader_pids: list[int] | None = None
    writer_pids: list[int] | None = None
    # A TCP connection no process holds the other end of: it waits unaccepted in the listen queue of the
    # processes holding the listening socket of that port (they would have to accept it).
    listener_pids: list[int] | None = None


class TcpSocket(_Model):
    """One TCP socket a process holds, read in its own network namespace: in a bundle merged from several
    hosts, a connection on one is matched to its other end on another by the exact 4-tuple."""

    fd: int | None = None            # None: a connection queued on one of its listeners, not accepted yet
    inode: int = 0
    proto: str = "tcp"               # "tcp" or "tcp6"
    local: str = ""                  # "ip:port"
    remote: str = ""                 # "0.0.0.0:0" for a listener
    state: str = ""                  # "listen", "established", "close_wait", ... (the kernel's names)


class ProgressSample(_Model):
    """What changed in the target over a short window before any tool paused it."""

    window_s: float = 0.0
    cpu_ticks: int = 0               # all threads, utime+stime
    io_delta: dict[str, int] = Field(default_factory=dict)     # /proc/PID/io: rchar, wchar, syscr, syscw
    log_growth: dict[str, int] = Field(default_factory=dict)   # log file path -> bytes written in the window
    gil_holders: list[int | None] = Field(default_factory=list)  # GIL holder TID at each sample (/proc mem)
    # Shared file mappings (ProcessEvidence.shared_maps) whose first bytes (a ring's indices, a counter)
    # changed during the window: "dev:inode" -> changed. Not part of ``advanced`` (a spinning reader
    # of a ring that does not move changes nothing of its own).
    shared_changed: dict[str, bool] = Field(default_factory=dict)
    # Write syscalls since the process started (/proc/PID/io syscw at the window's end; None: not read): a
    # producer that has written before and sleeps in a timer loop now is slow, not silent for good.
    writes_total: int | None = None

    @property
    def advanced(self) -> bool:
        """The process wrote to its log or did I/O during the window."""
        return any(v > 0 for v in self.log_growth.values()) or any(
            self.io_delta.get(k, 0) > 0 for k in ("wchar", "syscw", "rchar", "syscr"))


class ThreadObservation(_Model):
    """What one thread did between the progress window's two samples, read from /proc (None: not read).

    A wakeup alone is not progress: a timer that keeps firing (a heartbeat, a poll with a timeout) switches
    context every time and produces nothing. CPU time, I/O and a different syscall are."""

    samples: int = 2
    cpu_ticks: int | None = None             # utime + stime over the window
    voluntary_switches: int | None = None    # it blocked or slept and was woken
    nonvoluntary_switches: int | None = None  # the kernel preempted it while it ran
    same_syscall: bool | None = None         # the same syscall line (number and arguments) at both samples
    io_delta: dict[str, int] = Field(default_factory=dict)   # /proc/PID/task/TID/io: rchar, wchar, syscr, syscw

    @property
    def advanced(self) -> bool:
        """It used CPU, did I/O of its own, or was in a different syscall at the second sample."""
        return bool(self.cpu_ticks) or any(v > 0 for v in self.io_delta.values()) or self.same_syscall is False


class KernelWait(_Model):
    """A blocking syscall whose other party the kernel names: a file lock (holder from /proc/locks) or the
    open of a FIFO (who holds its other end)."""

    what: Literal["flock", "record_lock", "fifo_open"]
    path: str | None = None
    file: str | None = None                  # "major:minor:inode" of the file waited on
    # flock / record lock: the processes /proc/locks names as holding a conflicting lock on the file;
    # fifo_open: the processes that hold the FIFO open (any end). Empty: nobody; None: not read.
    holder_pids: list[int] | None = None
    access: str | None = None                # "read" / "write": the FIFO end being opened, the lock wanted


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
    # What a blocked syscall waits on beyond a read (None/empty: not such a wait, or not read):
    write_fds: list[FdInfo] = Field(default_factory=list)   # write/send blocked on these fds
    waited_pid: int | None = None    # wait4/waitid's pid argument (-1: any child)
    # The signals a sigwait (rt_sigtimedwait) waits for, read from its set in memory (None: not such a wait, or
    # unread).
    wait_signals: list[int] | None = None
    futex_mapping: SharedMapping | None = None   # the MAP_SHARED file mapping the futex address lies in
    observed: ThreadObservation | None = None   # its own two samples in the progress window (None: not observed)
    kernel_wait: KernelWait | None = None       # a file lock or FIFO open it is blocked in, and who holds it


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
    # The host the process ran on, for bundles merged from several hosts (fleet capture, ``kvdiag merge``):
    # a pid is unique only within its node. None: a single-host bundle.
    node: str | None = None
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
    # Established TCP connections ("local -> remote"), as bundles recorded them before ``tcp_sockets``.
    tcp_connections: list[str] = Field(default_factory=list)
    # Every TCP socket it holds (listening, connected, queued on its listeners); None: not read. In a bundle
    # merged from several hosts, a connection on one is matched to its other end on another.
    tcp_sockets: list[TcpSocket] | None = None
    netns: str | None = None         # its network namespace ("net:[4026531840]"): where the sockets were read
    net_addresses: list[str] | None = None   # that namespace's local addresses (None: not read)
    shared_maps: list[SharedMapping] | None = None   # MAP_SHARED file mappings (None: not read)
    # vLLM's shared-memory rings among them, their flags at both ends of the window (None: it maps none).
    shm_rings: list[RingReading] | None = None
    children: list[int] | None = None   # child pids (/proc/PID/task/*/children; None: not read)
    exited_children: list[int] | None = None   # of ``children``: those that exited and wait to be reaped
    # Why this process was captured although outside the requested tree: the wait edge that led to it.
    followed_from: str | None = None
    # Processes outside the tree a captured thread waits on: captured too, or named with why not.
    peers_outside: list[PeerProcess] = Field(default_factory=list)
    # The GPUs of the host it ran on, sampled over the capture window (None: not sampled, e.g. no GPU).
    gpu: GpuReadings | None = None
    # Its rank in a distributed job (torch.distributed's environment; None: none set, or not read).
    rank: RankIdentity | None = None
