"""`kvdiag doctor [--scenario FILE] [--log LOG] [--json]`: this host and a planned setup against known kvcached risks.

Collects the environment record (as every bundle carries it), the installed
kvcached's build fingerprint and its live state, then judges each known risk
per subject: a pre-fix build, prealloc with a pool of at most min_reserved
pages, co-location on one GPU, a GPU fuller than kvcached's headroom, a KV
block larger than a page. Nothing is started, attached or written.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.padding import Padding
from rich.text import Text

from kvdiag import __version__
from kvdiag.analyze.doctor import DEFAULT_KVCACHED_UTIL, EnginePlan, doctor_checks
from kvdiag.cli.common import read_log_lines
from kvdiag.environment import add_engine_packages, collect_environment
from kvdiag.errors import ExitCode
from kvdiag.kvcached.banner import parse_banners
from kvdiag.launch.engines import engine_env
from kvdiag.launch.interpreters import engine_interpreters
from kvdiag.model import BannerInfo, DoctorReport, EnvironmentRecord, RiskStatus
from kvdiag.redact import redact_obj
from kvdiag.report.envtext import environment_lines
from kvdiag.scenario import EngineSpec, Scenario, load_scenario
from kvdiag.sim.config import SimConfig

if TYPE_CHECKING:
    from kvdiag.launch.interpreters import EngineInterpreter

_STATUS_STYLE = {RiskStatus.RISK: "bold red", RiskStatus.WARN: "yellow", RiskStatus.OK: "green",
                 RiskStatus.UNKNOWN: "yellow", RiskStatus.NOT_APPLICABLE: "dim"}


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


def engine_plans(scenario: Scenario, environ: dict[str, str]) -> list[EnginePlan]:
    """Resolve each scenario engine as it would launch (scenario env over this process's env)."""
    plans: list[EnginePlan] = []
    for spec in scenario.ordered_engines():
        env = {**environ, **engine_env(spec)}
        plans.append(_plan(spec, env, scenario))
    return plans


def _plan(spec: EngineSpec, env: dict[str, str], scenario: Scenario) -> EnginePlan:
    errors: list[str] = []
    prealloc_raw = env.get("KVCACHED_PAGE_PREALLOC_ENABLED")
    # kvcached enables prealloc only for the exact word "true" (any case); unset means "true".
    prealloc = True if prealloc_raw is None else prealloc_raw.strip().lower() == "true"
    util = _num(env.get("KVCACHED_GPU_UTILIZATION"), float, errors, "KVCACHED_GPU_UTILIZATION")
    page_env = _num(env.get("KVCACHED_PAGE_SIZE_MB"), int, errors, "KVCACHED_PAGE_SIZE_MB")
    if spec.kind == "sim" or (spec.kind == "vllm" and spec.allocator != "external"):
        return _pool_plan(spec, env, scenario, prealloc, util, page_env, errors)
    argv = list(spec.command)
    kvcached = _true(env.get("ENABLE_KVCACHED")) or _true(env.get("KVCACHED_AUTOPATCH"))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    device = f"GPU {visible}" if visible else "GPU 0 (CUDA_VISIBLE_DEVICES unset)"
    gmu = _num(_flag(argv, "--gpu-memory-utilization"), float, errors, "--gpu-memory-utilization")
    bs = _num(_flag(argv, "--block-size"), int, errors, "--block-size")
    return EnginePlan(name=spec.name, kind="command", kvcached=kvcached, prealloc=prealloc, device=device,
                      gpu_memory_utilization=float(gmu) if gmu is not None else (0.9 if kvcached else None),
                      kvcached_util=float(util) if util is not None else DEFAULT_KVCACHED_UTIL,
                      page_size_mb=int(page_env) if page_env is not None else 2,
                      block_size=int(bs) if bs is not None else None, env_errors=errors)


def _pool_plan(spec: EngineSpec, env: dict[str, str], scenario: Scenario, prealloc: bool,
               util: float | int | None, page_env: float | int | None, errors: list[str]) -> EnginePlan:
    """An engine whose KV pool is kvdiag's allocator: a simulated engine, or a real vLLM engine with
    kvdiag's plugin (its ``vllm.pool``); both live on the run's modelled device."""
    defaults = SimConfig()
    pool = spec.sim if spec.kind == "sim" else spec.vllm.pool
    page = int(page_env) if page_env is not None else pool.page_size_mb
    pages = int(pool.kv_per_layer_mb) // page if page > 0 else 0
    min_res = _num(env.get("KVCACHED_MIN_RESERVED_PAGES"), int, errors, "KVCACHED_MIN_RESERVED_PAGES")
    max_res = _num(env.get("KVCACHED_MAX_RESERVED_PAGES"), int, errors, "KVCACHED_MAX_RESERVED_PAGES")
    what = "scenario engine" if spec.kind == "sim" else "vLLM engine (kvdiag's plugin)"
    banner = BannerInfo(
        num_layers=pool.layers, mem_size_per_layer_mb=int(pool.kv_per_layer_mb),
        total_mem_size_mb=2 * pool.layers * int(pool.kv_per_layer_mb), page_size_mb=page, world_size=1, pp_rank=0,
        async_sched=True, contiguous_layout=True, enable_prealloc=prealloc, num_kv_buffers=2, group_id=0,
        min_reserved_pages=min(int(min_res if min_res is not None else pool.min_reserved_pages), pages),
        max_reserved_pages=min(int(max_res if max_res is not None else pool.max_reserved_pages), pages),
        source=f"{what} {spec.name} (expected)")
    extra = spec.sim.extra_args if spec.kind == "sim" else spec.vllm.args
    tpp = _num(_flag(extra, "--tokens-per-page"), int, errors, "--tokens-per-page")
    bs = _num(_flag(extra, "--block-size"), int, errors, "--block-size")
    device = f"modelled device {scenario.device.name or '(this run)'} ({scenario.device.size_gb:g} GB)"
    return EnginePlan(name=spec.name, kind=spec.kind, kvcached=True, prealloc=prealloc, device=device,
                      allocator=spec.allocator if spec.allocator != "external" else "stock", banner=banner,
                      gpu_memory_utilization=spec.sim.gpu_memory_utilization if spec.kind == "sim" else None,
                      kvcached_util=float(util) if util is not None else DEFAULT_KVCACHED_UTIL,
                      page_size_mb=page,
                      tokens_per_page=(int(tpp) if tpp is not None else defaults.tokens_per_page)
                      if spec.kind == "sim" else None,
                      block_size=(int(bs) if bs is not None else defaults.block_size)
                      if spec.kind == "sim" else None, env_errors=errors)


def _load(scenario: str) -> tuple[Scenario, str]:
    scen, name, _ = load_scenario(Path(scenario))
    return scen, name


def _banners(logs: list[Path]) -> list[BannerInfo]:
    out: list[BannerInfo] = []
    for log in logs:
        out += parse_banners(read_log_lines(log), str(log))
    return out


def headline(env: EnvironmentRecord) -> list[str]:
    """The two facts a reader looks for first: GPUs and kvcached."""
    if env.gpus:
        gpu = f"GPUs: {len(env.gpus)} ({', '.join(sorted({g.name for g in env.gpus}))}), CUDA driver " \
              f"{env.cuda_driver or '?'}"
    else:
        gpu = f"GPU: none ({(env.gpu_note or 'no GPU').removeprefix('no GPU: ')})"
    lines = [gpu]
    for ip in env.engine_packages:
        k = ip.kvcached
        if k is not None:
            lines.append(f"kvcached of {ip.who} ({ip.python}): "
                         + (f"{k.version or '?'} at {k.location}: {k.summary}" if k.installed else "not installed"))
    k = env.kvcached
    mine = " (kvdiag's Python)" if env.engine_packages else ""
    if k.installed:
        lines.append(f"kvcached{mine}: {k.version or '?'} at {k.location}: {k.summary}")
    else:
        lines.append(f"kvcached{mine}: not installed here, so there is no kvcached build or live state to check")
    return lines


def render(report: DoctorReport, console: Console) -> None:
    console.rule(Text("kvdiag doctor", style="bold"))
    for line in headline(report.environment):
        console.print(Text(line, style="bold"))
    if report.scenario:
        console.print(Text(f"scenario: {report.scenario}"))
    else:
        console.print(Text("no scenario given: pass --scenario FILE (or --log LOG) to check a planned setup",
                           style="dim"))
    console.print(Text("environment", style="bold"))
    for line in environment_lines(report.environment):
        console.print(Text("  " + line))
    # One block per row, not a five-column table: at 80 columns a table breaks identifiers and the
    # environment assignments a reader copies (KVCACHED_PAGE_PREALLOC_ENABLED=false); here text wraps
    # only at spaces, under a hanging indent.
    console.print(Text("known risks", style="bold"))
    width = max(len(s.value) for s in RiskStatus) + 2
    for c in report.checks:
        head = Text()
        head.append(f"{c.status.value:<{width}}", style=_STATUS_STYLE[c.status])
        head.append(c.check, style="bold")
        head.append(f"  {c.subject}")
        console.print(head)
        console.print(Padding(Text(c.detail + (f" [{c.upstream}]" if c.upstream else "")), (0, 0, 0, width)))
        if c.fix:
            console.print(Padding(Text(f"change: {c.fix}"), (0, 0, 0, width)))
    for c in report.checks:
        if c.status is RiskStatus.WARN:
            console.print(Text(f"warning: {c.check}: {c.detail}" + (f"; fix: {c.fix}" if c.fix else ""),
                               style="yellow"))
    risks = [c for c in report.checks if c.status is RiskStatus.RISK]
    if risks:
        console.print(Text(f"{len(risks)} known risk(s) apply: "
                           f"{', '.join(sorted({c.check for c in risks}))} (exit {report.exit_code})",
                           style="bold red"))
    else:
        console.print(Text(f"no known risk applies (exit {report.exit_code})", style="bold green"))


def doctor_cmd(
    scenario: str | None = typer.Option(None, "--scenario", "-s", metavar="FILE",
                                        help="Scenario YAML to check as planned (`two-engine` = the embedded "
                                             "default)."),
    logs: list[Path] = typer.Option([], "--log", metavar="LOG",
                                    help="Engine log whose PageAllocator banners to check (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> int:
    """Check this host (GPUs, kvcached build, ptrace) and a planned setup against known kvcached risks.

    Exit codes: 0 no known risk applies, 10 at least one does, 2 bad usage or scenario.
    """
    scen_name: str | None = None
    plans: list[EnginePlan] = []
    interpreters: list[EngineInterpreter] = []
    if scenario is not None:
        scen, scen_name = _load(scenario)
        plans = engine_plans(scen, dict(os.environ))
        interpreters = engine_interpreters(scen)
    banners = _banners(list(logs))
    env = collect_environment()
    if interpreters:
        # The kvcached build (and versions) each engine's own interpreter imports, not only kvdiag's.
        add_engine_packages(env, interpreters)
    checks = doctor_checks(env, plans, banners)
    risky = any(c.status is RiskStatus.RISK for c in checks)
    report = redact_obj(DoctorReport(kvdiag_version=__version__, scenario=scen_name, environment=env, checks=checks,
                                     risky=risky, exit_code=ExitCode.DEADLOCK if risky else ExitCode.OK))
    if as_json:
        typer.echo(json.dumps(report.model_dump(mode="json"), indent=2, ensure_ascii=False))
    else:
        # Piped into a file or a bug report: wide enough for the table to stay readable.
        wide = sys.stdout.isatty() or os.environ.get("COLUMNS")
        render(report, Console(highlight=False, soft_wrap=False, width=None if wide else 120))
    return report.exit_code


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_cmd)


__all__ = ["doctor_cmd", "engine_plans", "headline", "register"]
