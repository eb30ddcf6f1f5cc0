"""Configuration of the simulated engine: command-line flags, kvcached's environment, presets.

Precedence for every setting: an explicit flag, then kvcached's environment variable
(where kvcached has one), then the preset (``--preset``), then the default.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvdiag.defaults import SIM_BLOCK_SIZE, SIM_TOKENS_PER_PAGE
from kvdiag.kvcached.settings import read_settings

MB = 1024 * 1024
GB = 1024 * MB

PHASES = ("load", "profile", "kv_init", "warmup", "serving")
FAIL_MODES = ("none", "signal", "raise", "oom")

# Option sets that make a behaviour happen; flags given explicitly still win.
PRESETS: dict[str, dict[str, Any]] = {
    # Runtime decode stall (seed issue 371, reproduction B): a small pool of small pages on a
    # device past the utilization headroom, so saturated streaming load brings the free list
    # down to a handful of pages and each decode step allocates a burst of pages. With the
    # stock allocator a burst lands while the prealloc worker has the last free pages in flight
    # and waits for the GIL: the engine wedges with KV near full and requests running.
    "decode-stall": {
        "layers": 1,
        "kv_per_layer_mb": 2048.0,
        "page_size_mb": 2,
        "tokens_per_page": 4,
        "max_running": 32,
        "step_ms": 5.0,
        "device_size_gb": 96.0,
        "weights_gb": 90.0,
        "max_model_len": 4096,
    },
}


@dataclass
class SimConfig:
    """Everything one simulated engine needs; picklable (it crosses into the EngineCore process). Grouped as
    ``kvdiag sim serve --help`` groups the flags."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "sim-model"
    served_model_name: str | None = None
    max_model_len: int = 4096
    # KV pool: kvcached's PageAllocator parameters, the page mapping, how many tokens a page holds
    layers: int = 28
    kv_per_layer_mb: float = 256.0
    page_size_mb: int = 2
    num_kv_buffers: int = 2
    allocator: str = "stock"
    backend: str = "host"
    prealloc: bool = True
    contiguous_layout: bool = True
    async_scheduling: bool = True
    min_reserved_pages: int = 5
    max_reserved_pages: int = 10
    kvcached_gpu_utilization: float = 0.95
    ipc_name: str = ""
    worker_ipc: bool = False
    map_latency_us: int = 0
    tokens_per_page: int = SIM_TOKENS_PER_PAGE
    block_size: int = SIM_BLOCK_SIZE
    # the modelled device
    device_name: str = "kvdiag0"
    device_size_gb: float = 96.0
    weights_gb: float = 0.0
    gpu_memory_utilization: float = 0.9
    # scheduler and decode
    max_running: int = 16
    step_ms: float = 5.0
    seed: int = 0
    # startup phase durations (seconds); --startup-s spreads one total over them
    load_s: float = 0.15
    profile_s: float = 0.1
    kv_init_s: float = 0.05
    warmup_s: float = 0.05
    slow_phase: str | None = None
    slow_s: float = 0.0
    progress_every_s: float = 1.0
    # failure injection
    fail_mode: str = "none"
    fail_at: str = "serving"
    fail_after_s: float = 0.0
    fail_after_tokens: int = 0
    fail_signal: str = "SIGKILL"
    # API server behaviour
    log_stats_interval_s: float = 10.0
    engine_dead_exit_s: float = 5.0
    access_log: bool = True
    warmup_wait_ms: float = 200.0
    preset: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The served model name (what /v1/models lists and metrics label)."""
        return self.served_model_name or self.model

    @property
    def mem_size_per_layer(self) -> int:
        return int(self.kv_per_layer_mb * MB)

    @property
    def page_size(self) -> int:
        return self.page_size_mb * MB

    @property
    def pages_per_layer(self) -> int:
        return self.mem_size_per_layer // self.page_size if self.page_size > 0 else 0

    @property
    def weights_bytes(self) -> int:
        return int(self.weights_gb * GB)

    @property
    def device_size(self) -> int:
        return int(self.device_size_gb * GB)

    def non_default(self) -> dict[str, Any]:
        """Settings that differ from the defaults (for vLLM's `non-default args` line)."""
        base = SimConfig()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "extra" and getattr(self, f.name) != getattr(base, f.name)}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_parser() -> argparse.ArgumentParser:
    """The `serve` argument parser (shared by `python -m kvdiag.sim` and `kvdiag sim serve`)."""
    p = argparse.ArgumentParser(
        prog="kvdiag sim serve",
        description="Serve a simulated kvcached vLLM engine (API server + EngineCore) on the kvdiag "
                    "page allocators. Flags left out fall back to kvcached's environment variables "
                    "(KVCACHED_PAGE_PREALLOC_ENABLED, KVCACHED_GPU_UTILIZATION, KVCACHED_PAGE_SIZE_MB, "
                    "KVCACHED_IPC_NAME, KVCACHED_MIN_RESERVED_PAGES, KVCACHED_MAX_RESERVED_PAGES, "
                    "KVCACHED_CONTIGUOUS_LAYOUT), then to --preset, then to the defaults shown.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    d = SimConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", help=f"listen address (default {d.host})")
    g.add_argument("--port", type=int, help=f"listen port (default {d.port})")
    g.add_argument("--model", help=f"model name reported by the API (default {d.model})")
    g.add_argument("--served-model-name", help="name served instead of --model")
    g.add_argument("--max-model-len", type=int, help=f"context length (default {d.max_model_len})")
    g.add_argument("--disable-uvicorn-access-log", dest="access_log", action="store_false",
                   help="do not log each request")
    g.add_argument("--log-stats-interval-s", type=float,
                   help=f"period of the `Engine 000: Avg prompt throughput` line (default "
                        f"{d.log_stats_interval_s:g}; 0 = never)")
    g.add_argument("--engine-dead-exit-s", type=float,
                   help=f"after EngineCore dies, /health is 503 and the API server exits this much later "
                        f"(default {d.engine_dead_exit_s:g}; VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it up)")
    g.add_argument("--preset", choices=sorted(PRESETS),
                   help="option set for a behaviour: decode-stall = small pool near the utilization "
                        "ceiling that wedges the stock allocator under saturated streaming load")

    g = p.add_argument_group("KV pool (kvcached PageAllocator)")
    g.add_argument("--layers", type=int, help=f"num_layers (default {d.layers})")
    g.add_argument("--kv-per-layer-mb", type=float,
                   help=f"mem_size_per_layer in MiB, fractions allowed (default {d.kv_per_layer_mb:g})")
    g.add_argument("--page-size-mb", type=int,
                   help=f"page size in MiB (env KVCACHED_PAGE_SIZE_MB, default {d.page_size_mb})")
    g.add_argument("--num-kv-buffers", type=int, help=f"2 for K and V, 1 for MLA (default {d.num_kv_buffers})")
    g.add_argument("--allocator", choices=["stock", "fixed", "reference"],
                   help=f"page allocator (default {d.allocator})")
    g.add_argument("--backend", choices=["host", "cuda"], help=f"page mapping backend (default {d.backend})")
    g.add_argument("--prealloc", choices=["true", "false"],
                   help="page prealloc (env KVCACHED_PAGE_PREALLOC_ENABLED; only 'true' enables; default true)")
    g.add_argument("--min-reserved-pages", type=int,
                   help=f"env KVCACHED_MIN_RESERVED_PAGES (default {d.min_reserved_pages})")
    g.add_argument("--max-reserved-pages", type=int,
                   help=f"env KVCACHED_MAX_RESERVED_PAGES (default {d.max_reserved_pages})")
    g.add_argument("--kvcached-gpu-utilization", type=float,
                   help=f"env KVCACHED_GPU_UTILIZATION (default {d.kvcached_gpu_utilization:g})")
    g.add_argument("--ipc-name", help="env KVCACHED_IPC_NAME (default kvcached_vLLM_<pgid>)")
    g.add_argument("--worker-ipc", choices=["true", "false"],
                   help="what kvcached's should_use_worker_ipc() answers in EngineCore: false (TP=1, the "
                        "model runner shares the process; pages map natively, default) or true (pages map "
                        "through the Python broadcast callback, as with a separate worker)")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="banner async_sched=0 (default async_sched=1, as in the seed)")
    g.add_argument("--map-latency-us", type=int, help=f"injected latency per page map (default {d.map_latency_us})")
    g.add_argument("--tokens-per-page", type=int,
                   help=f"tokens one KV page holds; a request holds ceil(tokens/this) pages "
                        f"(default {d.tokens_per_page})")
    g.add_argument("--block-size", type=int, help=f"vLLM block size, for the logs (default {d.block_size})")

    g = p.add_argument_group("modelled device")
    g.add_argument("--device-name", help=f"device shared by co-located engines (default {d.device_name})")
    g.add_argument("--device-size-gb", type=float, help=f"device memory (default {d.device_size_gb:g})")
    g.add_argument("--weights-gb", type=float,
                   help=f"model weights registered on the device (default {d.weights_gb:g})")
    g.add_argument("--gpu-memory-utilization", type=float,
                   help=f"vLLM's --gpu-memory-utilization, for the logs (default {d.gpu_memory_utilization:g})")

    g = p.add_argument_group("scheduler and decode")
    g.add_argument("--max-running", "--max-num-seqs", dest="max_running", type=int,
                   help=f"max running requests (default {d.max_running})")
    g.add_argument("--step-ms", type=float, help=f"latency of one decode step (default {d.step_ms:g})")
    g.add_argument("--seed", type=int, help=f"token stream seed (default {d.seed})")

    g = p.add_argument_group("startup")
    g.add_argument("--startup-s", type=float,
                   help="total simulated startup time, spread over load/profile/kv_init/warmup "
                        "(default about 0.35 s plus process start)")
    g.add_argument("--load-s", type=float, help="model load phase")
    g.add_argument("--profile-s", type=float, help="memory profiling phase")
    g.add_argument("--kv-init-s", type=float, help="KV cache init phase (before the allocator is built)")
    g.add_argument("--warmup-s", type=float, help="warm-up phase (after the null-block alloc_page)")
    g.add_argument("--slow-phase", choices=["load", "profile", "warmup"],
                   help="healthy-but-slow start: this phase takes --slow-s and logs progress")
    g.add_argument("--slow-s", type=float, help="duration of the slow phase")
    g.add_argument("--progress-every-s", type=float, help="progress line period in the slow phase (default 1)")
    g.add_argument("--warmup-wait-ms", type=float,
                   help=f"bound on the wait for the prealloc worker before the null-block alloc_page "
                        f"(default {d.warmup_wait_ms:g})")

    g = p.add_argument_group("failure injection")
    g.add_argument("--fail-mode", choices=list(FAIL_MODES),
                   help="signal: EngineCore dies by --fail-signal; raise: EngineCore raises; "
                        "oom: a page map fails with CUDA out of memory (kvcached aborts)")
    g.add_argument("--fail-at", choices=list(PHASES), help="phase in which to fail (default serving)")
    g.add_argument("--fail-after-s", type=float, help="serving: fail this long after startup")
    g.add_argument("--fail-after-tokens", type=int, help="serving: fail once this many tokens were generated")
    g.add_argument("--fail-signal", help="signal for --fail-mode signal (default SIGKILL)")
    return p


def _apply_env(cfg: SimConfig, given: set[str]) -> None:
    """kvcached's settings from the environment, each unless a flag gave it; a malformed one stops the engine
    (checked even when a flag overrides it)."""
    env = read_settings(os.environ)
    if env.errors:
        raise SystemExit(env.errors[0])
    if "prealloc" not in given:
        cfg.prealloc = env.prealloc_on
    if "contiguous_layout" not in given and env.contiguous_layout is not None:
        cfg.contiguous_layout = env.contiguous_layout
    for name, value in (("kvcached_gpu_utilization", env.gpu_utilization), ("page_size_mb", env.page_size_mb),
                        ("min_reserved_pages", env.min_reserved_pages), ("max_reserved_pages", env.max_reserved_pages)):
        if value is not None and name not in given:
            setattr(cfg, name, value)
    if "ipc_name" not in given:
        cfg.ipc_name = os.environ.get("KVCACHED_IPC_NAME", "") or f"kvcached_vLLM_{os.getpgrp()}"


def _spread_startup(cfg: SimConfig, total: float) -> None:
    cfg.load_s, cfg.profile_s, cfg.kv_init_s, cfg.warmup_s = (total * 0.45, total * 0.3, total * 0.1,
                                                              total * 0.15)


def validate(cfg: SimConfig) -> None:
    """Reject settings the engine cannot run with (raises SystemExit with one line)."""
    problems: list[str] = []
    if not 0 < cfg.port < 65536:
        problems.append(f"--port {cfg.port} is not a valid port")
    if cfg.layers < 1:
        problems.append("--layers must be >= 1")
    if cfg.page_size_mb < 1:
        problems.append("--page-size-mb must be >= 1")
    if cfg.kv_per_layer_mb <= 0:
        problems.append("--kv-per-layer-mb must be > 0")
    if cfg.max_running < 1:
        problems.append("--max-running must be >= 1")
    if cfg.step_ms < 0:
        problems.append("--step-ms must be >= 0")
    if cfg.tokens_per_page < 1:
        problems.append("--tokens-per-page must be >= 1")
    if cfg.fail_mode not in FAIL_MODES:
        problems.append(f"--fail-mode must be one of {', '.join(FAIL_MODES)}")
    if cfg.fail_at not in PHASES:
        problems.append(f"--fail-at must be one of {', '.join(PHASES)}")
    if cfg.max_model_len < 2:
        problems.append("--max-model-len must be >= 2")
    for name in ("load_s", "profile_s", "kv_init_s", "warmup_s", "slow_s", "device_size_gb", "weights_gb"):
        if getattr(cfg, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if problems:
        raise SystemExit("kvdiag sim: " + "; ".join(problems))


def parse_args(argv: list[str]) -> SimConfig:
    """Parse `serve` flags (a leading `serve` word is accepted) into a validated SimConfig."""
    if argv and argv[0] == "serve":
        argv = argv[1:]
    ns = build_parser().parse_args(argv)
    given = dict(vars(ns))
    cfg = SimConfig()
    preset = given.get("preset")
    if preset is not None:
        for key, value in PRESETS[preset].items():
            setattr(cfg, key, value)
    startup = given.pop("startup_s", None)
    if startup is not None:
        _spread_startup(cfg, float(startup))
    prealloc = given.pop("prealloc", None)
    worker_ipc = given.pop("worker_ipc", None)
    if worker_ipc is not None:
        cfg.worker_ipc = worker_ipc == "true"
    for key, value in given.items():
        setattr(cfg, key, value)
    explicit = set(given)
    if prealloc is not None:
        cfg.prealloc = prealloc == "true"
        explicit.add("prealloc")
    # A preset's page size is part of the behaviour it sets up: the environment must not undo it.
    if preset is not None:
        explicit |= set(PRESETS[preset])
    _apply_env(cfg, explicit)
    validate(cfg)
    return cfg
