"""kvcached's settings read once: doctor predicts the pool an engine launches with.

The launched side is read the way the engines themselves read it: a simulated engine parses the command
line and environment launch gives it (kvdiag.sim.config), the plugin in a vLLM EngineCore turns its
environment into allocator arguments (kvdiag.allocator.kvcached_env_kwargs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvdiag.allocator import kvcached_env_kwargs
from kvdiag.kvcached.settings import read_settings
from kvdiag.launch import engines
from kvdiag.runs.doctor import engine_plans
from kvdiag.runs.sweep.rule import engine_features
from kvdiag.scenario.loader import load_scenario
from kvdiag.scenario.models import Scenario
from kvdiag.sim.config import parse_args

SCENARIOS = sorted((Path(__file__).resolve().parents[2] / "scenarios").glob("*.yaml"))
MB = 1024 * 1024


def _launched(scenario: Scenario, monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[int, int, int, int]]:
    """Each kvdiag-allocator engine's (page size MB, pages per layer, min, max reserved) as it launches."""
    monkeypatch.setattr(engines, "find_vllm", lambda python: "vllm")
    out = {}
    for spec in scenario.ordered_engines():
        plan = engines.plan_engine(spec, 8000, "kvdiag-test", scenario.device.size_gb)
        env = {**os.environ, **plan.env}
        if spec.kind == "sim":
            with monkeypatch.context() as m:
                for k, v in env.items():
                    m.setenv(k, v)
                cfg = parse_args(plan.argv[plan.argv.index("serve"):])
            out[spec.name] = (cfg.page_size_mb, cfg.pages_per_layer, cfg.min_reserved_pages, cfg.max_reserved_pages)
        elif spec.kind == "vllm" and spec.allocator != "external":
            kw = kvcached_env_kwargs(env)
            page = kw["page_size"] // MB
            out[spec.name] = (page, int(spec.vllm.pool.kv_per_layer_mb * MB) // kw["page_size"],
                              kw["min_reserved_pages"], kw["max_reserved_pages"])
    return out


def _planned(scenario: Scenario) -> dict[str, tuple[int, int, int, int]]:
    out = {}
    for plan in engine_plans(scenario, dict(os.environ)):
        if plan.banner is not None and plan.page_size_mb is not None:
            b = plan.banner
            pages = b.mem_size_per_layer_mb // b.page_size_mb
            out[plan.name] = (plan.page_size_mb, pages, b.min_reserved_pages, b.max_reserved_pages)
    return out


def _clamped(launched: dict[str, tuple[int, int, int, int]]) -> dict[str, tuple[int, int, int, int]]:
    # The banner clamps the reserve to the pool, as kvcached's does.
    return {k: (p, n, min(lo, n), min(hi, n)) for k, (p, n, lo, hi) in launched.items()}


@pytest.fixture(autouse=True)
def _no_outer_kvcached(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("KVCACHED_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_doctor_plans_the_pages_per_layer_every_shipped_scenario_launches_with(
        path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = load_scenario(path)[0]
    launched = _launched(scenario, monkeypatch)
    assert _planned(scenario) == _clamped(launched)
    for spec in scenario.engines:
        if spec.name in launched:
            assert engine_features(spec)["pages_per_layer"] == launched[spec.name][1]


def test_a_page_size_variable_in_the_scenario_is_what_each_engine_kind_makes_of_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulated engine gets its page size as a flag, which wins over the variable; the plugin reads the
    variable. Before, doctor applied the variable to both and predicted 8 pages for the simulated engine."""
    scenario = load_scenario(None)[0]
    for spec in scenario.engines:
        spec.env["KVCACHED_PAGE_SIZE_MB"] = "4"
    launched = _launched(scenario, monkeypatch)
    assert {p for p, *_ in launched.values()} == {s.sim.page_size_mb for s in scenario.engines}
    assert _planned(scenario) == _clamped(launched)


def test_the_page_size_variable_changes_a_plugin_engines_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = load_scenario(SCENARIOS[[p.stem for p in SCENARIOS].index("two-engine-vllm-cpu")])[0]
    for spec in scenario.engines:
        spec.env["KVCACHED_PAGE_SIZE_MB"] = "4"
    launched = _launched(scenario, monkeypatch)
    assert launched and {p for p, *_ in launched.values()} == {4}
    assert _planned(scenario) == _clamped(launched)


def test_settings_read_as_kvcached_reads_them() -> None:
    s = read_settings({"KVCACHED_PAGE_PREALLOC_ENABLED": "1", "KVCACHED_PAGE_SIZE_MB": " ",
                       "KVCACHED_MIN_RESERVED_PAGES": "x", "KVCACHED_GPU_UTILIZATION": "0.5"})
    assert (s.prealloc, s.prealloc_on, s.page_size_mb, s.min_reserved_pages, s.gpu_utilization) == (
        False, False, None, None, 0.5)
    assert s.errors == ("invalid KVCACHED_MIN_RESERVED_PAGES='x': expected an integer",)
    assert read_settings({}).prealloc_on and read_settings({}).pages_per_layer(11) == 5
