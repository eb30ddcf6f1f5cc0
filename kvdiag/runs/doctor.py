"""`kvdiag doctor`'s run: this host and a planned setup against known kvcached risks.

Collects the environment record (as every bundle carries it), the installed kvcached's build fingerprint
and its live state, then judges each known risk per subject: a pre-fix build, prealloc with a pool of at
most min_reserved pages, co-location on one GPU, a GPU fuller than kvcached's headroom, a KV block larger
than a page. Each engine is planned as it would launch (:func:`kvdiag.launch.engines.launched_pool`).
Nothing is started, attached or written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kvdiag import __version__
from kvdiag.analyze.doctor import DEFAULT_KVCACHED_UTIL, EnginePlan, doctor_checks
from kvdiag.defaults import SIM_BLOCK_SIZE, SIM_TOKENS_PER_PAGE
from kvdiag.environment import add_engine_packages, collect_environment
from kvdiag.errors import ExitCode
from kvdiag.kvcached.banner import parse_banners
from kvdiag.kvcached.settings import DEFAULT_PAGE_SIZE_MB, read_settings
from kvdiag.launch.engines import engine_env, launched_pool
from kvdiag.launch.interpreters import EngineInterpreter, engine_interpreters
from kvdiag.logs.lines import read_log_lines
from kvdiag.model.doctor import DoctorCheck, DoctorReport, RiskStatus
from kvdiag.model.run import BannerInfo
from kvdiag.redact.rules import redact_obj
from kvdiag.scenario.loader import load_scenario
from kvdiag.scenario.models import EngineSpec, Scenario


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("true", "1", "yes", "on")


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _num(text: str | None, cast: type[float] | type[int], errors: list[str], what: str) -> float | int | None:
    if text is None or text == "":
        return None
    try:
        return cast(text)
    except ValueError:
        errors.append(f"{what}={text!r} is not a number")
        return None


def engine_plans(scenario: Scenario, environ: Mapping[str, str]) -> list[EnginePlan]:
    """Resolve each scenario engine as it would launch (scenario env over this process's env)."""
    return [_plan(spec, environ, scenario) for spec in scenario.ordered_engines()]


def _plan(spec: EngineSpec, environ: Mapping[str, str], scenario: Scenario) -> EnginePlan:
    if spec.kind == "sim" or (spec.kind == "vllm" and spec.allocator != "external"):
        return _pool_plan(spec, environ, scenario)
    env = {**environ, **engine_env(spec)}
    settings = read_settings(env)
    errors = list(settings.errors)
    argv = list(spec.command)
    kvcached = _true(env.get("ENABLE_KVCACHED")) or _true(env.get("KVCACHED_AUTOPATCH"))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    device = f"GPU {visible}" if visible else "GPU 0 (CUDA_VISIBLE_DEVICES unset)"
    gmu = _num(_flag(argv, "--gpu-memory-utilization"), float, errors, "--gpu-memory-utilization")
    bs = _num(_flag(argv, "--block-size"), int, errors, "--block-size")
    util = settings.gpu_utilization
    return EnginePlan(name=spec.name, kind="command", kvcached=kvcached, prealloc=settings.prealloc_on,
                      device=device,
                      gpu_memory_utilization=float(gmu) if gmu is not None else (0.9 if kvcached else None),
                      kvcached_util=util if util is not None else DEFAULT_KVCACHED_UTIL,
                      page_size_mb=settings.page_size_mb or DEFAULT_PAGE_SIZE_MB,
                      block_size=int(bs) if bs is not None else None, env_errors=errors)


def _pool_plan(spec: EngineSpec, environ: Mapping[str, str], scenario: Scenario) -> EnginePlan:
    """An engine whose KV pool is kvdiag's allocator: a simulated engine, or a real vLLM engine with
    kvdiag's plugin (its ``vllm.pool``); both live on the run's modelled device."""
    settings = launched_pool(spec, environ)
    assert settings is not None
    errors = list(settings.errors)
    pool = spec.sim if spec.kind == "sim" else spec.vllm.pool
    page = settings.page_size_mb if settings.page_size_mb is not None else pool.page_size_mb
    pages = settings.pages_per_layer(pool.kv_per_layer_mb, pool.page_size_mb)
    min_res = settings.min_reserved_pages
    max_res = settings.max_reserved_pages
    what = "scenario engine" if spec.kind == "sim" else "vLLM engine (kvdiag's plugin)"
    banner = BannerInfo(
        num_layers=pool.layers, mem_size_per_layer_mb=int(pool.kv_per_layer_mb),
        total_mem_size_mb=2 * pool.layers * int(pool.kv_per_layer_mb), page_size_mb=page, world_size=1, pp_rank=0,
        async_sched=True, contiguous_layout=True, enable_prealloc=settings.prealloc_on, num_kv_buffers=2,
        group_id=0,
        min_reserved_pages=min(int(min_res if min_res is not None else pool.min_reserved_pages), pages),
        max_reserved_pages=min(int(max_res if max_res is not None else pool.max_reserved_pages), pages),
        source=f"{what} {spec.name} (expected)")
    extra = spec.sim.extra_args if spec.kind == "sim" else spec.vllm.args
    tpp = _num(_flag(extra, "--tokens-per-page"), int, errors, "--tokens-per-page")
    bs = _num(_flag(extra, "--block-size"), int, errors, "--block-size")
    device = f"modelled device {scenario.device.name or '(this run)'} ({scenario.device.size_gb:g} GB)"
    util = settings.gpu_utilization
    return EnginePlan(name=spec.name, kind=spec.kind, kvcached=True, prealloc=settings.prealloc_on, device=device,
                      allocator=spec.allocator if spec.allocator != "external" else "stock", banner=banner,
                      gpu_memory_utilization=spec.sim.gpu_memory_utilization if spec.kind == "sim" else None,
                      kvcached_util=util if util is not None else DEFAULT_KVCACHED_UTIL,
                      page_size_mb=page,
                      tokens_per_page=(int(tpp) if tpp is not None else SIM_TOKENS_PER_PAGE)
                      if spec.kind == "sim" else None,
                      block_size=(int(bs) if bs is not None else SIM_BLOCK_SIZE)
                      if spec.kind == "sim" else None, env_errors=errors)


def doctor_report(scenario: str | None, logs: list[Path]) -> DoctorReport:
    """This host (and the scenario's engines' own interpreters) judged against the known risks."""
    scen_name: str | None = None
    plans: list[EnginePlan] = []
    interpreters: list[EngineInterpreter] = []
    if scenario is not None:
        scen, scen_name, _ = load_scenario(Path(scenario))
        plans = engine_plans(scen, dict(os.environ))
        interpreters = engine_interpreters(scen)
    banners: list[BannerInfo] = []
    bare: list[DoctorCheck] = []
    for log in logs:
        found = parse_banners(read_log_lines(log), str(log))
        banners += found
        if not found:   # a log that judged nothing must not read as "no known risk" from it
            bare.append(DoctorCheck(
                check="prealloc_pool", subject=f"log {log}", status=RiskStatus.UNKNOWN,
                detail="no `Init C++ PageAllocator` banner in it, so nothing was judged from this log (kvcached "
                       "prints the banner when an engine allocates its KV cache: pass the engine's own log)"))
    env = collect_environment()
    if interpreters:
        # The kvcached build (and versions) each engine's own interpreter imports, not only kvdiag's.
        add_engine_packages(env, interpreters)
    checks = doctor_checks(env, plans, banners) + bare
    risky = any(c.status is RiskStatus.RISK for c in checks)
    return redact_obj(DoctorReport(kvdiag_version=__version__, scenario=scen_name, logs=[str(p) for p in logs],
                                   environment=env, checks=checks,
                                   risky=risky, exit_code=ExitCode.DEADLOCK if risky else ExitCode.OK))
