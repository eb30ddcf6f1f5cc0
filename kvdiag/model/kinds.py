"""Verdict kinds and their specs, the base model, and the small enums every stage shares."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict

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
    # No evidence is not health: outcomes that say why nothing could be judged.
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
    # A host thread parked in a CUDA synchronization (stream/event/device synchronize, a blocking
    # device-to-host copy, a NCCL wait) for the whole window while the GPU reports busy: a kernel that
    # never finishes. The host's locks and the GIL are consequences, not the cause.
    GPU_KERNEL_HANG = "gpu_kernel_hang"
    # Ranks of one collective group sit in different collectives (or at different call sites), or one
    # never arrived: every other rank waits forever. The rank that left and where it is are named.
    COLLECTIVE_MISMATCH = "collective_mismatch"

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
    # A root cause like the host cycles above it; ranked before a blocked read or a decode stall, which a
    # kernel that never ends produces in the processes waiting on it (the API server, the scheduler).
    _K.GPU_KERNEL_HANG: KindSpec("hang", ExitCode.DEADLOCK, 4, "bad"),
    # The ranks that wait are consequences of the one that left: ranked above the blocked reads and stalls
    # it causes elsewhere, below the host cycles that may be why a rank never arrived.
    _K.COLLECTIVE_MISMATCH: KindSpec("hang", ExitCode.DEADLOCK, 5, "bad"),
    _K.BLOCKED_IPC_READ: KindSpec("hang", ExitCode.DEADLOCK, 6, "bad"),
    _K.DECODE_STALL: KindSpec("hang", ExitCode.DEADLOCK, 7, "bad"),
    _K.OOM: KindSpec("engine_failed", ExitCode.ENGINE_FAILED, 8, "fail"),
    _K.CRASH: KindSpec("engine_failed", ExitCode.ENGINE_FAILED, 9, "fail"),
    _K.UNKNOWN: KindSpec("hang", ExitCode.DEADLOCK, 10, "unk"),
    _K.STOPPED: KindSpec("target_state", ExitCode.TARGET_STOPPED, 11, "warn"),
    _K.TRACED: KindSpec("target_state", ExitCode.TARGET_STOPPED, 12, "warn"),
    _K.NO_ACCESS: KindSpec("no_evidence", ExitCode.NO_ACCESS, 13, "warn"),
    _K.NO_EVIDENCE: KindSpec("no_evidence", ExitCode.NO_ACCESS, 14, "warn"),
    _K.EXITED: KindSpec("no_evidence", ExitCode.NOT_DIAGNOSABLE, 15, "unk"),
    _K.ZOMBIE: KindSpec("no_evidence", ExitCode.NOT_DIAGNOSABLE, 16, "unk"),
    _K.NOT_PYTHON: KindSpec("no_evidence", ExitCode.NOT_DIAGNOSABLE, 17, "unk"),
    _K.KERNEL_THREAD: KindSpec("no_evidence", ExitCode.NOT_DIAGNOSABLE, 18, "unk"),
    _K.INCONCLUSIVE: KindSpec("inconclusive", ExitCode.INCONCLUSIVE, 19, "unk"),
    _K.SLOW_START: KindSpec("inconclusive", ExitCode.OK, 20, "warn"),
    _K.NOT_SATURATED: KindSpec("inconclusive", ExitCode.NOT_SATURATED, 21, "warn"),
    _K.HEALTHY: KindSpec("healthy", ExitCode.OK, 22, "ok"),
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
