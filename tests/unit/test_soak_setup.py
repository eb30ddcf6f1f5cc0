"""Soak setup: the soak-hybrid scenario, option validation, and finding a server's pid by its port."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvdiag.capture.locate import is_local_host, server_pid, url_host_port
from kvdiag.errors import UsageError
from kvdiag.osread.net import listening_pids
from kvdiag.runs.soak.options import SoakOptions, load_soak_scenario, single_engine
from kvdiag.scenario.loader import load_scenario

ROOT = Path(__file__).resolve().parents[2]


def test_soak_hybrid_scenario_is_valid_and_embedded() -> None:
    scen, _, text = load_scenario(ROOT / "scenarios" / "soak-hybrid.yaml")
    builtin, name, builtin_text = load_soak_scenario(None)
    assert name == "<builtin>/soak-hybrid.yaml"
    assert text == builtin_text, "scenarios/soak-hybrid.yaml and kvdiag/scenario/builtin/soak-hybrid.yaml differ"
    e = scen.engines[0]
    assert e.kind == "sim" and e.allocator == "stock" and e.prealloc is True
    assert e.env["KVCACHED_PAGE_SIZE_MB"] == "4" and e.env["KVCACHED_CONTIGUOUS_LAYOUT"] == "false"
    assert e.env["KVCACHED_GPU_UTILIZATION"] == "0.95"
    # the pool sits past the 5 % utilization headroom of the modelled device
    kv_gb = 2 * e.sim.layers * e.sim.kv_per_layer_mb / 1024
    assert e.sim.weights_gb + kv_gb > scen.device.size_gb * 0.95
    assert scen.windows.stall_s == 5


def test_single_engine_overrides() -> None:
    scen, _, _ = load_scenario(None)   # two engines, the second starts after the first
    one = single_engine(scen, "fixed", 2.5)
    assert [e.name for e in one.engines] == [scen.engines[0].name]
    assert one.engines[0].allocator == "fixed" and one.engines[0].start_after is None
    assert one.windows.stall_s == 2.5
    assert scen.windows.stall_s == 5 and scen.engines[0].allocator == "stock"   # the original is untouched
    two = single_engine(scen.model_copy(update={"engines": scen.engines[1:]}), None, None)
    assert two.engines[0].start_after is None


@pytest.mark.parametrize("kw,needle", [
    ({"duration_s": 0}, "--duration"),
    ({"concurrency": 0}, "--concurrency"),
    ({"max_tokens": 0}, "--max-tokens"),
    ({"stall_window_s": -1.0}, "--stall-window"),
    ({"read_timeout_s": 4.0}, "--read-timeout"),
    ({"model": "Qwen/Qwen3.6-27B-FP8"}, "needs --url"),
    ({"url": "localhost:8000"}, "not an http(s) URL"),
    ({"url": "http://127.0.0.1:8000", "allocator": "fixed"}, "--allocator"),
    ({"url": "http://127.0.0.1:8000", "scenario": Path("x.yaml")}, "exclude"),
])
def test_option_errors(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(UsageError) as exc:
        SoakOptions(**kw).validate()  # type: ignore[arg-type]
    assert needle in exc.value.message


def test_valid_options() -> None:
    SoakOptions().validate()
    SoakOptions(url="http://127.0.0.1:8000", model="my-model").validate()
    SoakOptions(model="real", scenario=Path("s.yaml")).validate()


def test_listening_socket_found_by_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert os.getpid() not in listening_pids(port)   # bound, not listening
        s.listen(1)
        pids = listening_pids(port)
        assert os.getpid() in pids
        assert server_pid(pids) == os.getpid()
    assert os.getpid() not in listening_pids(port)


def test_url_helpers() -> None:
    assert url_host_port("http://127.0.0.1:8400/") == ("127.0.0.1", 8400)
    assert url_host_port("https://example.org") == ("example.org", 443)
    with pytest.raises(ValueError):
        url_host_port("127.0.0.1:8400")
    assert is_local_host("127.0.0.1") and is_local_host("localhost") and is_local_host("::1")
    assert is_local_host("0.0.0.0")
    assert not is_local_host("192.0.2.1")       # TEST-NET-1: never this machine
