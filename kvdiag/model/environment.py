"""The machine a bundle was captured on and the kvcached build it carries."""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import Field, model_validator

from kvdiag.model.fleet import NodeRecord
from kvdiag.model.kinds import _Model


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


class HostRecord(_Model):
    """What an offline reader needs to interpret a bundle's syscall numbers and stacks (no hostname)."""

    machine: str = ""                # platform.machine(): x86_64, aarch64 (picks the syscall table)
    system: str = ""
    kernel: str = ""
    python: str = ""
    cpus: int | None = None
    # The kernel's boot id: with each process's network namespace, what tells two hosts' captures apart
    # in a merge (None: not read).
    boot_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _untyped(cls, data: Any) -> Any:
        """Bundles written before the record was typed: a dict of strings, some with hostname and platform."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k in cls.model_fields}
            cpus = data.get("cpus")
            if isinstance(cpus, str):
                data["cpus"] = int(cpus) if cpus.isdigit() else None
        return data


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
    # A bundle merged from several hosts (fleet capture, ``kvdiag merge``): one row per node.
    nodes: list[NodeRecord] = Field(default_factory=list)
