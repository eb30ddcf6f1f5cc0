"""Turn a scenario's engine spec into a command line and environment."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.interpreter import module_argv
from kvdiag.scenario.models import EngineSpec


@dataclass(frozen=True)
class LaunchPlan:
    name: str
    argv: list[str]
    env: dict[str, str]
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def sim_argv(spec: EngineSpec, port: int, device_name: str, device_size_gb: float) -> list[str]:
    """Command line of a built-in simulated engine (`python -m kvdiag.sim serve ...`)."""
    s = spec.sim
    argv = [
        *module_argv("kvdiag.sim"), "serve",
        "--host", spec.host, "--port", str(port), "--model", spec.model,
        "--layers", str(s.layers), "--kv-per-layer-mb", f"{s.kv_per_layer_mb:g}",
        "--page-size-mb", str(s.page_size_mb),
        "--allocator", spec.allocator if spec.allocator != "external" else "stock",
        "--backend", s.backend, "--device-name", device_name, "--device-size-gb", f"{device_size_gb:g}",
        "--weights-gb", f"{s.weights_gb:g}", "--gpu-memory-utilization", f"{s.gpu_memory_utilization:g}",
        "--max-running", str(s.max_running), "--step-ms", f"{s.step_ms:g}",
        "--map-latency-us", str(s.map_latency_us),
    ]
    if s.startup_s is not None:
        argv += ["--startup-s", f"{s.startup_s:g}"]
    return argv + list(s.extra_args)


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """Environment additions for one engine: the scenario's env plus derived kvcached settings."""
    env = dict(spec.env)
    if spec.prealloc is not None:
        env["KVCACHED_PAGE_PREALLOC_ENABLED"] = "true" if spec.prealloc else "false"
    if spec.kind == "sim":
        env.setdefault("KVCACHED_MIN_RESERVED_PAGES", str(spec.sim.min_reserved_pages))
        env.setdefault("KVCACHED_MAX_RESERVED_PAGES", str(spec.sim.max_reserved_pages))
        env.setdefault("KVCACHED_PAGE_SIZE_MB", str(spec.sim.page_size_mb))
    return env


def plan_engine(spec: EngineSpec, port: int, device_name: str, device_size_gb: float) -> LaunchPlan:
    if spec.kind == "sim":
        argv = sim_argv(spec, port, device_name, device_size_gb)
    else:
        argv = list(spec.command)
    return LaunchPlan(spec.name, argv, engine_env(spec), spec.host, port)
