"""Scenario models: what a YAML scenario may say. Unknown keys are errors."""

from __future__ import annotations

import re
from typing import Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvdiag import defaults as D

ToolName = Literal["pystack", "py-spy", "gdb", "proc"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_Reserved = TypeVar("_Reserved", "SimParams", "PoolParams")


def _reserved_in_order(pool: _Reserved) -> _Reserved:
    """A pool's reserve bounds: the prealloc worker keeps between min and max reserved pages."""
    if pool.min_reserved_pages > pool.max_reserved_pages:
        raise ValueError("min_reserved_pages must not exceed max_reserved_pages")
    return pool


class SimParams(_Strict):
    """Parameters of a built-in simulated engine (kvdiag sim serve)."""

    layers: int = Field(28, ge=1, le=4096)
    kv_per_layer_mb: float = Field(11, gt=0)
    page_size_mb: int = Field(2, ge=1)
    min_reserved_pages: int = Field(5, ge=0)
    max_reserved_pages: int = Field(10, ge=0)
    weights_gb: float = Field(0.0, ge=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_running: int = Field(16, ge=1)
    step_ms: float = Field(5.0, ge=0)
    backend: Literal["host", "cuda"] = "host"
    map_latency_us: int = Field(0, ge=0)
    startup_s: float | None = Field(None, ge=0)
    extra_args: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _reserved_order(self) -> SimParams:
        return _reserved_in_order(self)


class PoolParams(_Strict):
    """The KV pool kvdiag's vLLM plugin builds in a real EngineCore, where kvcached builds its PageAllocator.

    The geometry is the modelled engine's (the seed's engine 2: 28 layers x 11 MB, 2 MB pages), not the
    served model's: the pool is host memory on the run's modelled device, and vLLM's request blocks are
    spread over its pages.
    """

    layers: int = Field(28, ge=1, le=4096)
    kv_per_layer_mb: float = Field(11, gt=0)
    page_size_mb: int = Field(2, ge=1)
    min_reserved_pages: int = Field(5, ge=0)
    max_reserved_pages: int = Field(10, ge=0)
    map_latency_us: int = Field(0, ge=0)
    # How long the null-block alloc waits (GIL held, as Python code between the two calls does) for the
    # prealloc worker to have pages in flight: the ordering a real GPU engine's CUDA init produces.
    warmup_wait_ms: float = Field(200.0, ge=0, le=10_000)

    @model_validator(mode="after")
    def _reserved_order(self) -> PoolParams:
        return _reserved_in_order(self)


class VllmParams(_Strict):
    """A real `vllm serve` engine (kind: vllm)."""

    args: list[str] = Field(default_factory=list)   # extra `vllm serve` arguments ({port}, {host}, {model} work)
    pool: PoolParams = Field(default_factory=PoolParams)


class EngineSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    kind: Literal["sim", "command", "vllm"] = "sim"
    model: str = "sim-model"
    port: int = Field(0, ge=0, le=65535)          # 0 = pick a free port
    host: str = "127.0.0.1"
    allocator: Literal["stock", "fixed", "external"] = "stock"
    prealloc: bool | None = None                  # None = leave KVCACHED_PAGE_PREALLOC_ENABLED as env says
    start_after: str | None = None                # start once this engine is ready
    ready: str = "health"                         # "health" or "log:<regex>"
    env: dict[str, str] = Field(default_factory=dict)
    command: list[str] = Field(default_factory=list)
    cwd: str | None = None
    # kind vllm: the Python environment with vLLM (a venv folder or its python); default $KVDIAG_VLLM_VENV,
    # else the `vllm` found on PATH. `~` and ${VAR} expand here and in model.
    python: str | None = None
    sim: SimParams = Field(default_factory=SimParams)
    vllm: VllmParams = Field(default_factory=VllmParams)
    expect: Literal["healthy", "hang", "any"] = "any"

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
            raise ValueError("engine names use letters, digits, '.', '_' and '-' only")
        return v

    @field_validator("ready")
    @classmethod
    def _ready_ok(cls, v: str) -> str:
        if v == "health":
            return v
        if v.startswith("log:"):
            try:
                re.compile(v[4:])
            except re.error as exc:
                raise ValueError(f"invalid regex in ready: {exc}") from exc
            return v
        raise ValueError("ready must be 'health' or 'log:<regex>'")

    @field_validator("env")
    @classmethod
    def _env_keys(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"invalid environment variable name {key!r}")
        return v

    @model_validator(mode="after")
    def _command_needed(self) -> EngineSpec:
        if self.kind == "command" and not self.command:
            raise ValueError("engines of kind 'command' need a command")
        if self.kind == "vllm" and self.command:
            raise ValueError("engines of kind 'vllm' build their command (`vllm serve MODEL --port {port} ...`); "
                             "put extra arguments in vllm.args, or use kind: command")
        return self


class Windows(_Strict):
    stall_s: float = Field(D.STALL_WINDOW_S, gt=0, le=3600)          # no progress this long = stall
    startup_timeout_s: float = Field(D.STARTUP_TIMEOUT_S, gt=0)      # per engine, to become ready
    timeout_s: float = Field(D.RUN_TIMEOUT_S, gt=0)                  # whole run
    poll_s: float = Field(D.POLL_S, gt=0, le=10)
    kill_grace_s: float = Field(D.KILL_GRACE_S, ge=0, le=120)        # SIGTERM → SIGKILL grace at teardown


class CaptureSpec(_Strict):
    tools: list[ToolName] = Field(
        default_factory=lambda: [cast(ToolName, t) for t in D.DEFAULT_TOOLS])
    tool_timeout_s: float = Field(D.TOOL_TIMEOUT_S, gt=0, le=600)
    when: Literal["stall", "always", "never"] = "stall"   # ("on" would parse as a YAML boolean)


class ServeSpec(_Strict):
    """After every engine is ready, serve requests for a while (hangs that come while serving).

    Each ready engine gets one request after another (non-streaming completions of ``max_tokens``);
    the first answer is its warm-up (bounded by ``windows.startup_timeout_s``), then a request in
    flight with no answer for ``windows.stall_s`` is a stall, captured like a start-up stall.
    """

    duration_s: float = Field(20.0, gt=0, le=3600)     # how long to serve once every engine answered
    max_tokens: int = Field(16, ge=1, le=4096)


class DeviceSpec(_Strict):
    """The modelled device shared by co-located simulated engines."""

    name: str | None = None          # None = unique per run, so parallel runs never collide
    size_gb: float = Field(96.0, gt=0)


class Scenario(_Strict):
    name: str = "scenario"
    description: str = ""
    engines: list[EngineSpec] = Field(min_length=1)
    windows: Windows = Field(default_factory=Windows)
    capture: CaptureSpec = Field(default_factory=CaptureSpec)
    device: DeviceSpec = Field(default_factory=DeviceSpec)
    serve: ServeSpec | None = None

    @model_validator(mode="after")
    def _references(self) -> Scenario:
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError("engine names must be unique")
        ports = [e.port for e in self.engines if e.port]
        if len(set(ports)) != len(ports):
            raise ValueError("two engines use the same port")
        for e in self.engines:
            if e.start_after is not None and e.start_after not in names:
                raise ValueError(f"engine {e.name!r}: start_after names unknown engine {e.start_after!r}")
            if e.start_after == e.name:
                raise ValueError(f"engine {e.name!r} cannot start after itself")
        return self

    def ordered_engines(self) -> list[EngineSpec]:
        """Engines in start order: file order, moved after their start_after dependency."""
        done: list[EngineSpec] = []
        pending = list(self.engines)
        while pending:
            progressed = False
            for e in list(pending):
                if e.start_after is None or any(d.name == e.start_after for d in done):
                    done.append(e)
                    pending.remove(e)
                    progressed = True
            if not progressed:
                raise ValueError("start_after forms a cycle")
        return done
