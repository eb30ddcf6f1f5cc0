"""The `vllm` engine kind, the {port} placeholder, engines' private temp files and kvdiag's vLLM plugin,
without vLLM itself (the real-vLLM tests are in tests/vllm/)."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import stat
import sys
import time
from pathlib import Path

import pytest

from kvdiag.errors import ScenarioError, ToolMissing
from kvdiag.launch.engines import PORT_ENV, plan_engine
from kvdiag.launch.owned import sweep_shm
from kvdiag.launch.process import ENGINE_TEMP_DIRS, ProcessSet
from kvdiag.launch.vllm import ENTRY_POINT_GROUP, expand, stage_plugin
from kvdiag.osread.holders import file_id
from kvdiag.osread.net import listening_ports
from kvdiag.scenario.loader import load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]


def _fake_venv(tmp: Path) -> Path:
    exe = tmp / "venv" / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe.parent.parent


def _vllm_scenario(venv: Path, extra: str = "") -> str:
    return f"""
engines:
  - name: e1
    kind: vllm
    model: ${{KVDIAG_TEST_MODEL:-/models/tiny}}
    python: {venv}
    allocator: stock
    prealloc: true
    env: {{KVCACHED_IPC_NAME: E1}}
    vllm:
      args: [--enforce-eager, --served-model-name, "{{name}}-on-{{port}}"]
      pool: {{layers: 28, kv_per_layer_mb: 11, min_reserved_pages: 5, max_reserved_pages: 5}}
{extra}"""


def test_vllm_engine_plan_has_port_model_plugin_and_kvcached_env(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDIAG_TEST_MODEL", raising=False)
    venv = _fake_venv(tmp_path)
    spec = parse_scenario(_vllm_scenario(venv)).engines[0]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = plan_engine(spec, 45123, "kvdiag-dev-x", 96.0, run_dir=run_dir)
    assert plan.argv[:3] == [str(venv / "bin" / "vllm"), "serve", "/models/tiny"]
    assert plan.argv[3:7] == ["--host", "127.0.0.1", "--port", "45123"]
    assert plan.argv[-2:] == ["--served-model-name", "e1-on-45123"]
    env = plan.env
    assert env[PORT_ENV] == "45123"
    assert env["KVDIAG_VLLM_ALLOCATOR"] == "stock" and env["KVDIAG_VLLM_DEVICE"] == "kvdiag-dev-x"
    assert env["KVDIAG_VLLM_LAYERS"] == "28" and env["KVDIAG_VLLM_KV_PER_LAYER_MB"] == "11"
    assert env["KVCACHED_MIN_RESERVED_PAGES"] == "5" and env["KVCACHED_PAGE_PREALLOC_ENABLED"] == "true"
    assert env["KVCACHED_IPC_NAME"] == "E1"
    site = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert site.parent == run_dir and (site / "kvdiag" / "vllm_plugin" / "__init__.py").is_file()
    assert Path(env["KVDIAG_NATIVE_PATH"]).is_file()


def test_external_allocator_gets_no_plugin(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path)
    spec = parse_scenario(_vllm_scenario(venv).replace("allocator: stock", "allocator: external")).engines[0]
    plan = plan_engine(spec, 40000, "d", 96.0, run_dir=tmp_path)
    assert not any(k.startswith("KVDIAG_VLLM_") for k in plan.env) and "PYTHONPATH" not in plan.env


def test_staged_plugin_is_a_vllm_general_plugin_entry_point(tmp_path: Path) -> None:
    site = stage_plugin(tmp_path)
    eps = [ep for dist in importlib.metadata.distributions(path=[str(site)])
           for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
    assert [(ep.name, ep.value) for ep in eps] == [("kvdiag", "kvdiag.vllm_plugin:register")]
    assert (site / "kvdiag").resolve() == (ROOT / "kvdiag").resolve() or (site / "kvdiag" / "__init__.py").is_file()


def test_missing_vllm_is_a_tool_missing_error(tmp_path: Path) -> None:
    spec = parse_scenario(_vllm_scenario(tmp_path / "nowhere")).engines[0]
    with pytest.raises(ToolMissing, match="vLLM not found"):
        plan_engine(spec, 40000, "d", 96.0)


def test_vllm_kind_rejects_a_command() -> None:
    with pytest.raises(ScenarioError, match="vllm.args"):
        parse_scenario("engines:\n  - name: a\n    kind: vllm\n    command: [vllm, serve, x]\n")


def test_port_placeholder_in_command_engines() -> None:
    spec = parse_scenario("engines:\n  - name: a\n    kind: command\n    model: m\n"
                          "    command: [srv, '--port={port}', --host, '{host}', --json, '{\"k\": 1}']\n").engines[0]
    plan = plan_engine(spec, 41234, "d", 96.0)
    assert plan.argv == ["srv", "--port=41234", "--host", "127.0.0.1", "--json", '{"k": 1}']
    assert plan.env[PORT_ENV] == "41234"


def test_expand_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDIAG_NOT_SET", raising=False)
    monkeypatch.setenv("KVDIAG_IS_SET", "/x")
    assert expand("${KVDIAG_NOT_SET:-/d}/m") == "/d/m"
    assert expand("${KVDIAG_IS_SET:-/d}/m") == "/x/m"
    assert expand("~/m") == os.path.expanduser("~/m")


@pytest.mark.parametrize("name", ["two-engine-vllm-cpu.yaml", "soak-vllm-cpu.yaml"])
def test_vllm_scenarios_parse(name: str) -> None:
    scen, _, _ = load_scenario(ROOT / "scenarios" / name)
    assert all(e.kind == "vllm" for e in scen.engines)


def test_engines_temp_files_go_to_the_run_folder_removed_at_teardown() -> None:
    with ProcessSet(grace_s=1) as procs:
        env = procs.env_for({})
        run_dir = procs.run_dir()
        for key, sub in ENGINE_TEMP_DIRS.items():
            assert env[key] == str(run_dir / sub) and (run_dir / sub).is_dir()
        assert run_dir.name.startswith("kvdiag-run-")
        # the scenario's own value wins
        assert procs.env_for({"TMPDIR": "/elsewhere"})["TMPDIR"] == "/elsewhere"
    assert not run_dir.exists()


def test_sweep_shm_removes_only_new_unused_segments_the_run_was_seen_holding(tmp_path: Path) -> None:
    old = tmp_path / "psm_old"
    old.write_bytes(b"x")
    time.sleep(1.3)  # older than the run start by more than sweep_shm's 1 s slack
    since = time.time()
    new, held, stranger = tmp_path / "psm_new", tmp_path / "psm_held", tmp_path / "sem.mp-stranger"
    for p in (new, held, stranger):
        p.write_bytes(b"x")
    other = tmp_path / "kvdiag-dev-x.acct"
    other.write_bytes(b"x")
    seen = {file_id(str(p)) for p in (old, new, held, other)}
    with open(held, "rb"):   # a live holder (this process), whatever the name
        swept = sweep_shm(since, {f for f in seen if f}, shm_dir=str(tmp_path))
    assert swept.removed == ["psm_new"]
    assert swept.left == ["sem.mp-stranger"]   # looks like a leftover, never seen held by the run: named only
    assert old.exists() and other.exists() and held.exists() and stranger.exists() and not new.exists()


def test_listening_ports_of_a_process() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port in listening_ports([os.getpid()])


def test_plugin_is_inert_without_its_variable_or_outside_engine_core(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvdiag.vllm_plugin as plugin

    monkeypatch.delenv(plugin.ENABLE_ENV, raising=False)
    plugin.register()
    monkeypatch.setenv(plugin.ENABLE_ENV, "stock")
    plugin.register()  # this process is not a vLLM EngineCore
    assert "vllm" not in sys.modules and not plugin._installed


def test_pool_backing_serves_blocks_through_the_allocator() -> None:
    from kvdiag.allocator import make_allocator
    from kvdiag.vllm_plugin import PoolBacking

    mb = 1024 * 1024
    alloc = make_allocator("fixed", num_layers=2, mem_size_per_layer=10 * mb, page_size=2 * mb,
                           enable_prealloc=False, backend="host", device_name=f"kvdiag-ut-{os.getpid()}-vllm",
                           device_size=1 << 30)
    try:
        null = alloc.alloc_page()
        backing = PoolBacking(alloc, num_blocks=16)       # 4 pages left for 15 blocks
        assert backing.slots == 4
        for b in range(1, 16):
            backing.hold(b)
        assert alloc.get_num_inuse_pages() == 5
        for b in range(1, 8):
            backing.release(b)
        assert 2 <= alloc.get_num_inuse_pages() < 5        # pages still holding blocks 8..15 stay
        for b in range(8, 16):
            backing.release(b)
        assert alloc.get_num_inuse_pages() == 1            # the null block's page
        alloc.free_page(null)
    finally:
        from kvdiag.allocator import remove_device_files

        remove_device_files(f"kvdiag-ut-{os.getpid()}-vllm")


def test_socket_folder_moves_to_tmp_when_the_temp_dir_is_too_deep(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with ProcessSet(grace_s=1) as procs:
        rpc = Path(procs.env_for({})["VLLM_RPC_BASE_PATH"])
        assert rpc.parent == Path("/tmp") and rpc.name.startswith("kvdiag-rpc-") and rpc.is_dir()
        assert len(str(rpc)) + 37 <= 107
        assert procs.env_for({})["TMPDIR"].startswith(str(deep))
    assert not rpc.exists()
