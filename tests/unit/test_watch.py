"""Log phase tracking, log following and the stall detector (clock injected, no sleeping)."""

from __future__ import annotations

from pathlib import Path

from kvdiag.logs.lines import LogState, feed_line
from kvdiag.model.kinds import EnginePhase
from kvdiag.watch.logs import LogFollower, scan_file
from kvdiag.watch.metrics import parse_metrics
from kvdiag.watch.stall import Observation, StallDetector

VLLM = Path(__file__).resolve().parents[2].parent / "shared" / "vllm"


def test_phases_and_pids_from_lines() -> None:
    st = LogState()
    feed_line(st, "(APIServer pid=6790) INFO 12-03 06:15:30 [api_utils.py:286] non-default args: {}")
    feed_line(st, "(Worker pid=6946) INFO 12-03 06:15:45 [cpu_model_runner.py:68] Starting to load model x...")
    feed_line(st, "(EngineCore pid=6898) INFO 12-03 06:15:45 [kv_cache_utils.py:2327] CPU KV cache size: 2,048 tokens")
    assert st.phase is EnginePhase.KV_INIT
    feed_line(st, "Init C++ PageAllocator: num_layers=28, mem_size_per_layer=11MB, total_mem_size=616MB, "
                  "page_size=2MB, world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1, enable_prealloc=1, "
                  "num_kv_buffers=2, group_id=0, min_reserved_pages=5, max_reserved_pages=5")
    assert st.phase is EnginePhase.BANNER and len(st.banners) == 1
    assert st.pids == {"api_server": 6790, "worker": 6946, "engine_core": 6898}
    feed_line(st, "(EngineCore pid=6898) INFO later: Starting to load model again")
    assert st.phase is EnginePhase.BANNER  # never moves back


def test_real_vllm_startup_log_reaches_serving() -> None:
    log = VLLM / "startup.log"
    if not log.exists():
        import pytest

        pytest.skip("shared vLLM captures not present")
    st = scan_file(log)
    assert st.phase is EnginePhase.SERVING
    assert st.pids["engine_core"] == 6898 and st.pids["api_server"] == 6790


def test_oom_and_errors_detected() -> None:
    st = LogState()
    feed_line(st, "RuntimeError: CUDA error: out of memory")
    assert st.oom and st.errors


def test_follower_handles_partial_lines(tmp_path: Path) -> None:
    p = tmp_path / "x.log"
    f = LogFollower(p)
    assert f.read_new() == []
    p.write_bytes(b"one\ntw")
    assert f.read_new() == ["one"]
    with open(p, "ab") as fh:
        fh.write(b"o\nthree\n")
    assert f.read_new() == ["two", "three"]


def test_stall_detector_startup_window() -> None:
    d = StallDetector(window_s=5.0)
    assert not d.observe(Observation(now=0, new_log_lines=3, cpu_ticks=100, healthy=False))
    assert not d.observe(Observation(now=2, new_log_lines=0, cpu_ticks=100, healthy=False))
    assert not d.observe(Observation(now=4.9, new_log_lines=0, cpu_ticks=100, healthy=False))
    assert d.observe(Observation(now=5.0, new_log_lines=0, cpu_ticks=101, healthy=False))
    assert d.stalled_since == 0


def test_cpu_progress_is_slow_start_not_stall() -> None:
    d = StallDetector(window_s=5.0)
    ticks = 0
    for i in range(40):
        ticks += 50  # half a core busy, no log output
        assert not d.observe(Observation(now=i * 0.5, new_log_lines=0, cpu_ticks=ticks, healthy=False))


def test_decode_stall_when_serving() -> None:
    d = StallDetector(window_s=5.0)
    assert not d.observe(Observation(now=0, new_log_lines=0, cpu_ticks=None, healthy=True, tokens=10, running=4))
    assert not d.observe(Observation(now=1, new_log_lines=0, cpu_ticks=None, healthy=True, tokens=20, running=4))
    assert not d.observe(Observation(now=5, new_log_lines=0, cpu_ticks=None, healthy=True, tokens=20, running=4))
    assert d.observe(Observation(now=6, new_log_lines=0, cpu_ticks=None, healthy=True, tokens=20, running=4))
    # idle (nothing running) is never a stall
    d2 = StallDetector(window_s=1.0)
    for t in range(10):
        assert not d2.observe(Observation(now=t, new_log_lines=0, cpu_ticks=None, healthy=True, tokens=0, running=0))


def test_parse_real_metrics() -> None:
    path = VLLM / "metrics_after_load.txt"
    if not path.exists():
        import pytest

        pytest.skip("shared vLLM captures not present")
    snap = parse_metrics(path.read_text(), t=1.0)
    assert snap.kv_cache_usage is not None and snap.generation_tokens is not None
    assert snap.running is not None


def test_stall_window_is_not_applied_before_the_first_log_line() -> None:
    """An interpreter that has printed nothing yet (busy machine) is starting, not stalled."""
    d = StallDetector(window_s=5.0)
    for t in range(0, 60):  # a minute of silence with no CPU progress, before any output
        assert not d.observe(Observation(now=float(t), new_log_lines=0, cpu_ticks=100, healthy=False,
                                         output_started=False))
    # the first line arms the window; silence after it is a stall one window later
    assert not d.observe(Observation(now=60.0, new_log_lines=1, cpu_ticks=100, healthy=False, output_started=True))
    assert not d.observe(Observation(now=64.0, new_log_lines=0, cpu_ticks=100, healthy=False, output_started=True))
    assert d.observe(Observation(now=65.5, new_log_lines=0, cpu_ticks=100, healthy=False, output_started=True))
    assert d.stalled_since == 60.0


def test_parse_metrics_sums_label_sets_and_survives_a_malformed_line() -> None:
    text = (
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 120.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 30.0\n'
        'vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:num_requests_running{engine="0"} NaN\n'
    )
    snap = parse_metrics(text, t=2.0, engine="e")
    assert snap.generation_tokens == 150.0 and snap.kv_cache_usage == 0.5 and snap.running is None
    broken = text + "this is { not prometheus\n"  # one bad line must not cost the whole scrape
    again = parse_metrics(broken, t=2.0)
    assert again.generation_tokens == 150.0 and again.kv_cache_usage == 0.5
