"""`kvdiag doctor`: the real command in a child process, on this host and on scenarios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.analyze.doctor import EnginePlan, colocation_checks, headroom_checks
from kvdiag.environment import collect_environment
from kvdiag.kvcached.build import fingerprint_tree
from kvdiag.model.doctor import RiskStatus
from kvdiag.model.environment import GpuInfo

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SEED_BANNER = """(EngineCore) INFO ... init engine (profile, create kv cache, warmup model) took 10.58 seconds
Init C++ PageAllocator: num_layers=28, mem_size_per_layer=11MB, total_mem_size=667MB,
  page_size=2MB, world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1,
  enable_prealloc=1, num_kv_buffers=2, group_id=0, min_reserved_pages=5, max_reserved_pages=5
"""

pytestmark = pytest.mark.timeout(120)


def doctor(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "doctor", *args], capture_output=True, text=True,
                          timeout=90, cwd=ROOT, env={**os.environ, "COLUMNS": "200", **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr


def rows(out: str) -> list[dict[str, str]]:
    data = json.loads(out)
    return [c for c in data["checks"] if c["status"] == "risk"]


@pytest.fixture(scope="module")
def host() -> tuple[bool, bool]:
    env = collect_environment(runtime=False)
    return bool(env.gpus), env.kvcached.installed


def test_no_gpu_no_kvcached_says_so_and_exits_0(host: tuple[bool, bool]) -> None:
    if host != (False, False):
        pytest.skip("this host has a GPU or kvcached")
    code, out = doctor()
    assert code == 0, out
    assert "GPU: none" in out and "kvcached: not installed here" in out
    assert "no known risk applies (exit 0)" in out
    assert "Traceback" not in out


def test_default_two_engine_scenario_flags_the_seed_risk() -> None:
    code, out = doctor("--scenario", "two-engine", "--json")
    assert code == 10, out
    risks = {(c["check"], c["subject"]) for c in rows(out)}
    assert ("prealloc_pool", "engine vlm") in risks           # 11 MB / 2 MB = 5 pages = min_reserved
    assert ("prealloc_pool", "engine coder") not in risks     # 141 pages
    assert any(c == "colocation" for c, _ in risks)
    pool = next(c for c in rows(out) if c["check"] == "prealloc_pool")
    assert "KVCACHED_PAGE_PREALLOC_ENABLED=false" in pool["fix"] and pool["upstream"] == "kvcached #371"
    # the same, as a table
    code, text = doctor("--scenario", str(ROOT / "scenarios" / "two-engine.yaml"))
    assert code == 10 and "known risk(s) apply" in text and "prealloc_pool" in text


def test_prealloc_off_scenario_has_no_risk_from_the_scenario() -> None:
    code, out = doctor("--scenario", str(ROOT / "scenarios" / "two-engine-prealloc-off.yaml"), "--json")
    scenario_risks = [c for c in rows(out) if c["subject"].startswith(("engine", "modelled"))]
    assert scenario_risks == []
    assert code == (10 if rows(out) else 0)


def test_banner_from_a_log(tmp_path: Path) -> None:
    log = tmp_path / "eng2.log"
    log.write_text(SEED_BANNER)
    code, out = doctor("--log", str(log), "--json")
    assert code == 10
    assert [c["check"] for c in rows(out)].count("prealloc_pool") == 1


def test_pre_fix_kvcached_on_the_path_is_flagged() -> None:
    """A kvcached importable from PYTHONPATH with the pre-fix binding shapes (not imported, only read)."""
    code, out = doctor("--json", env={"PYTHONPATH": str(FIXTURES / "kvcached_prefix")})
    assert code == 10, out
    data = json.loads(out)
    assert data["environment"]["kvcached"]["verdict"] == "pre_fix"
    build = next(c for c in rows(out) if c["check"] == "allocator_build")
    assert "#371" in (build["upstream"] or "") and "0.1.6" in build["fix"]
    code, out = doctor("--json", env={"PYTHONPATH": str(FIXTURES / "kvcached_postfix")})
    assert json.loads(out)["environment"]["kvcached"]["verdict"] == "fixed"
    assert not [c for c in rows(out) if c["check"] == "allocator_build"]


def test_usage_errors_exit_2() -> None:
    code, out = doctor("--scenario", "/nonexistent/scenario.yaml")
    assert code == 2 and "Traceback" not in out
    code, out = doctor("--log", "/nonexistent/eng.log")
    assert code == 2 and "not found" in out


def test_headroom_and_colocation_rules() -> None:
    env = collect_environment(gpus=False, runtime=False)
    env.gpus = [GpuInfo(index=0, name="H200", total_mb=143_000, free_mb=4_000),
                GpuInfo(index=1, name="H200", total_mb=143_000, free_mb=60_000)]
    env.kvcached = fingerprint_tree(FIXTURES / "kvcached_prefix")
    got = {c.subject: c for c in headroom_checks([], env)}
    assert got["GPU 0"].status is RiskStatus.RISK and "#377" in got["GPU 0"].detail
    assert got["GPU 1"].status is RiskStatus.OK
    a = EnginePlan(name="a", kind="command", kvcached=True, prealloc=True, device="GPU 0")
    b = EnginePlan(name="b", kind="command", kvcached=True, prealloc=True, device="GPU 0")
    c = EnginePlan(name="c", kind="command", kvcached=True, prealloc=True, device="GPU 1")
    by = {r.subject: r.status for r in colocation_checks([a, b, c], env)}
    assert by == {"GPU 0": RiskStatus.RISK, "GPU 1": RiskStatus.OK}
    env.kvcached = fingerprint_tree(FIXTURES / "kvcached_postfix")
    assert {r.status for r in colocation_checks([a, b], env)} == {RiskStatus.OK}


def test_refused_capture_is_a_warning_with_its_fix() -> None:
    from kvdiag.analyze.doctor import access_checks, doctor_checks
    from kvdiag.environment.ptrace import judge

    env = collect_environment(gpus=False, runtime=False)
    env.ptrace = judge(env.ptrace.model_copy(update={"yama_ptrace_scope": 1, "cap_sys_ptrace": False,
                                                     "container": "docker"}))
    (row,) = access_checks(env)
    assert row.status is RiskStatus.WARN and "--cap-add=SYS_PTRACE" in (row.fix or "")
    # a warning, not a hang risk: it alone does not make doctor exit 10
    env.kvcached = fingerprint_tree(FIXTURES / "kvcached_postfix")
    assert not [c for c in doctor_checks(env) if c.status is RiskStatus.RISK]


def test_vllm_engines_pools_are_judged_like_simulated_ones() -> None:
    # kind: vllm with kvdiag's plugin: the pool (vllm.pool), the co-location and the stock allocator
    # are the same risks as on simulated engines; `repro` on this file hangs in the GIL cycle.
    code, out = doctor("--scenario", "scenarios/two-engine-vllm-cpu.yaml", "--json")
    assert code == 10, out
    risks = {(c["check"], c["subject"]) for c in rows(out)}
    assert ("prealloc_pool", "engine vlm") in risks
    assert ("allocator_build", "engine vlm") in risks
    assert any(check == "colocation" for check, _ in risks)
    assert ("prealloc_pool", "engine coder") not in risks     # 283 MB / 2 MB pages: a big pool
