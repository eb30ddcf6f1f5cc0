"""Turn a scenario's engine spec into a command line and environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvdiag.kvcached import settings
from kvdiag.kvcached.settings import PoolSettings, read_settings
from kvdiag.launch.vllm import agent_library, expand, find_vllm, native_library, stage_plugin
from kvdiag.pymodule import module_argv
from kvdiag.scenario.models import EngineSpec

PORT_ENV = "KVDIAG_ENGINE_PORT"
PLACEHOLDERS = ("{port}", "{host}", "{model}", "{name}")


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


def substitute(arg: str, spec: EngineSpec, port: int, model: str | None = None) -> str:
    """``{port}``, ``{host}``, ``{model}`` and ``{name}`` in one argument (other braces stay as written)."""
    if "{" not in arg:
        return arg
    return (arg.replace("{port}", str(port)).replace("{host}", spec.host)
            .replace("{model}", model if model is not None else spec.model).replace("{name}", spec.name))


def vllm_argv(spec: EngineSpec, port: int) -> list[str]:
    """`vllm serve MODEL --host H --port P ARGS...` from the engine's vLLM environment."""
    model = expand(spec.model)
    return [find_vllm(spec.python), "serve", model, "--host", spec.host, "--port", str(port),
            *(substitute(a, spec, port, model) for a in spec.vllm.args)]


def vllm_env(spec: EngineSpec, device_name: str, device_size_gb: float, run_dir: Path | None) -> dict[str, str]:
    """What kvdiag's plugin in the EngineCore reads (kvdiag.vllm_plugin), when kvdiag's allocator is used."""
    if spec.allocator == "external":
        return {}
    pool = spec.vllm.pool
    env = {
        "KVDIAG_VLLM_ALLOCATOR": spec.allocator,
        "KVDIAG_VLLM_ENGINE": spec.name,
        "KVDIAG_VLLM_LAYERS": str(pool.layers),
        "KVDIAG_VLLM_KV_PER_LAYER_MB": f"{pool.kv_per_layer_mb:g}",
        "KVDIAG_VLLM_MAP_LATENCY_US": str(pool.map_latency_us),
        "KVDIAG_VLLM_WARMUP_WAIT_MS": f"{pool.warmup_wait_ms:g}",
        "KVDIAG_VLLM_DEVICE": device_name,
        "KVDIAG_VLLM_DEVICE_SIZE_GB": f"{device_size_gb:g}",
        "KVCACHED_PAGE_SIZE_MB": str(pool.page_size_mb),
        "KVCACHED_MIN_RESERVED_PAGES": str(pool.min_reserved_pages),
        "KVCACHED_MAX_RESERVED_PAGES": str(pool.max_reserved_pages),
    }
    native = native_library()
    if native:
        env["KVDIAG_NATIVE_PATH"] = native
    dumper = agent_library()
    if dumper:   # the in-process agent, armed only where KVDIAG_AGENT=1
        env["KVDIAG_AGENT_NATIVE"] = dumper
    if run_dir is not None:
        site = stage_plugin(run_dir)
        old = spec.env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{site}{os.pathsep}{old}" if old else str(site)
    return env


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


def _last_flag(argv: list[str], name: str) -> str | None:
    """The value of ``name`` in ``argv`` as argparse takes it (the last one given wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


# A simulated engine's flags for kvcached's settings: given, a flag wins over the variable.
_SIM_FLAGS = (("--page-size-mb", settings.PAGE_SIZE_MB), ("--min-reserved-pages", settings.MIN_RESERVED),
              ("--max-reserved-pages", settings.MAX_RESERVED), ("--kvcached-gpu-utilization", settings.GPU_UTILIZATION),
              ("--prealloc", settings.PREALLOC))


def launched_pool(spec: EngineSpec, environ: Mapping[str, str] | None = None) -> PoolSettings | None:
    """The kvcached settings an engine with kvdiag's allocator (a simulated engine, or vLLM with kvdiag's
    plugin) launches with, as :func:`plan_engine` starts it under ``environ`` (default: this process's);
    None for any other engine. What doctor and sweep predict is this."""
    if not (spec.kind == "sim" or (spec.kind == "vllm" and spec.allocator != "external")):
        return None
    env = {**(os.environ if environ is None else environ), **engine_env(spec)}
    if spec.kind == "vllm":
        pool = spec.vllm.pool
        defaults = {settings.PAGE_SIZE_MB: str(pool.page_size_mb),
                    settings.MIN_RESERVED: str(pool.min_reserved_pages),
                    settings.MAX_RESERVED: str(pool.max_reserved_pages)}
        env.update({k: v for k, v in defaults.items() if k not in spec.env})
    else:
        argv = sim_argv(spec, 0, "", 0.0)
        for flag, name in _SIM_FLAGS:
            value = _last_flag(argv, flag)
            if value is not None:
                env[name] = value
    return read_settings(env)


def plan_engine(spec: EngineSpec, port: int, device_name: str, device_size_gb: float,
                run_dir: Path | None = None) -> LaunchPlan:
    """Command line and environment of one engine on ``port``; ``run_dir`` is the run's private temp folder
    (kind vllm stages kvdiag's plugin there)."""
    env = engine_env(spec)
    if spec.kind == "sim":
        argv = sim_argv(spec, port, device_name, device_size_gb)
    elif spec.kind == "vllm":
        argv = vllm_argv(spec, port)
        for key, value in vllm_env(spec, device_name, device_size_gb, run_dir).items():
            env.setdefault(key, value)
    else:
        argv = [substitute(a, spec, port) for a in spec.command]
    env[PORT_ENV] = str(port)
    return LaunchPlan(spec.name, argv, env, spec.host, port)
