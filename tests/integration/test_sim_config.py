"""The simulated engine's configuration: flags, kvcached's environment variables, presets, command()."""

from __future__ import annotations

import pytest

from kvdiag.pymodule import module_argv
from kvdiag.sim.cmdline import command
from kvdiag.sim.config import PRESETS, SimConfig, parse_args

_KVCACHED_ENV = ("KVCACHED_PAGE_PREALLOC_ENABLED", "KVCACHED_GPU_UTILIZATION", "KVCACHED_PAGE_SIZE_MB",
                 "KVCACHED_IPC_NAME", "KVCACHED_MIN_RESERVED_PAGES", "KVCACHED_MAX_RESERVED_PAGES",
                 "KVCACHED_CONTIGUOUS_LAYOUT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _KVCACHED_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("value", "enabled"), [("true", True), ("TRUE", True), (" True ", True), ("1", False),
                                                ("yes", False), ("false", False), ("", False)])
def test_only_the_word_true_enables_prealloc(monkeypatch: pytest.MonkeyPatch, value: str, enabled: bool) -> None:
    monkeypatch.setenv("KVCACHED_PAGE_PREALLOC_ENABLED", value)
    assert parse_args(["serve"]).prealloc is enabled


def test_prealloc_defaults_on_and_flag_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([]).prealloc is True
    monkeypatch.setenv("KVCACHED_PAGE_PREALLOC_ENABLED", "true")
    assert parse_args(["--prealloc", "false"]).prealloc is False


def test_kvcached_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_GPU_UTILIZATION", "0.8")
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "4")
    monkeypatch.setenv("KVCACHED_IPC_NAME", "VLMM")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "3")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "7")
    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "false")
    cfg = parse_args(["serve", "--port", "8400"])
    assert (cfg.kvcached_gpu_utilization, cfg.page_size_mb, cfg.ipc_name) == (0.8, 4, "VLMM")
    assert (cfg.min_reserved_pages, cfg.max_reserved_pages, cfg.contiguous_layout) == (3, 7, False)
    # An explicit flag wins over the environment.
    assert parse_args(["--page-size-mb", "2", "--min-reserved-pages", "5"]).page_size_mb == 2


def test_default_ipc_name_follows_kvcached() -> None:
    import os

    assert parse_args([]).ipc_name == f"kvcached_vLLM_{os.getpgrp()}"


def test_seed_engine2_parameters() -> None:
    cfg = parse_args(["--layers", "28", "--kv-per-layer-mb", "11", "--page-size-mb", "2",
                      "--min-reserved-pages", "5", "--max-reserved-pages", "5"])
    assert cfg.pages_per_layer == 5 and cfg.mem_size_per_layer == 11 * 1024 * 1024


def test_preset_sets_a_stall_prone_pool_and_flags_still_win() -> None:
    cfg = parse_args(["--preset", "decode-stall", "--max-running", "8"])
    for key, value in PRESETS["decode-stall"].items():
        if key != "max_running":
            assert getattr(cfg, key) == value
    assert cfg.max_running == 8
    # Past the utilization headroom once the pool fills: device free < (1 - 0.95) * size.
    kv_bytes = cfg.pages_per_layer * cfg.page_size * cfg.layers * cfg.num_kv_buffers
    assert cfg.device_size - cfg.weights_bytes - kv_bytes < 0.05 * cfg.device_size


@pytest.mark.parametrize("argv", [["--port", "0"], ["--layers", "0"], ["--tokens-per-page", "0"],
                                  ["--allocator", "nope"], ["--fail-at", "never"]])
def test_bad_flags_exit_with_one_line(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code not in (0, None)


def test_startup_s_spreads_over_the_phases() -> None:
    cfg = parse_args(["--startup-s", "2"])
    assert abs(cfg.load_s + cfg.profile_s + cfg.kv_init_s + cfg.warmup_s - 2.0) < 1e-9


def test_command_round_trips_through_the_parser() -> None:
    argv = command(8401, layers=28, kv_per_layer_mb=11.0, page_size_mb=2, allocator="fixed", prealloc=False,
                   device_name="dev0", weights_gb=16.0, min_reserved_pages=5, max_reserved_pages=5,
                   extra={"fail-mode": "raise", "fail_at": "load", "no-async-scheduling": True,
                          "worker-ipc": None})
    head = module_argv("kvdiag.sim")  # the user's folder stays off the engine's sys.path
    assert argv[:len(head) + 1] == [*head, "serve"] and "-P" in head
    cfg = parse_args(argv[len(head):])
    want = SimConfig(port=8401, layers=28, kv_per_layer_mb=11.0, page_size_mb=2, allocator="fixed", prealloc=False,
                     device_name="dev0", weights_gb=16.0, min_reserved_pages=5, max_reserved_pages=5,
                     fail_mode="raise", fail_at="load", async_scheduling=False)
    for field in ("port", "layers", "kv_per_layer_mb", "page_size_mb", "allocator", "prealloc", "device_name",
                  "weights_gb", "min_reserved_pages", "max_reserved_pages", "fail_mode", "fail_at",
                  "async_scheduling"):
        assert getattr(cfg, field) == getattr(want, field), field
    assert command(1, extra=["--step-ms", "1"])[-2:] == ["--step-ms", "1"]
