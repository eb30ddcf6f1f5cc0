"""Banner parser and static risk check on kvcached's exact banner format."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.kvcached.banner import assess_risk, parse_banner, parse_banners

ENGINE2 = ("Init C++ PageAllocator: num_layers=28, mem_size_per_layer=11MB, total_mem_size=667MB, "
           "page_size=2MB, world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1, enable_prealloc=1, "
           "num_kv_buffers=2, group_id=0, min_reserved_pages=5, max_reserved_pages=5")
ENGINE1 = ("Init C++ PageAllocator: num_layers=64, mem_size_per_layer=283MB, total_mem_size=36248MB, "
           "page_size=2MB, world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1, enable_prealloc=1, "
           "num_kv_buffers=2, group_id=0, min_reserved_pages=5, max_reserved_pages=10")


def test_parses_every_field() -> None:
    b = parse_banner("(EngineCore pid=1) " + ENGINE2, 7, "eng2")
    assert b is not None
    assert (b.num_layers, b.mem_size_per_layer_mb, b.total_mem_size_mb, b.page_size_mb) == (28, 11, 667, 2)
    assert b.async_sched and b.contiguous_layout and b.enable_prealloc
    assert (b.min_reserved_pages, b.max_reserved_pages, b.line_no, b.source) == (5, 5, 7, "eng2")


def test_seed_engine2_is_risky_engine1_is_not() -> None:
    b2, b1 = parse_banner(ENGINE2), parse_banner(ENGINE1)
    assert b1 is not None and b2 is not None
    r2, r1 = assess_risk(b2), assess_risk(b1)
    assert r2.risky and r2.pages_per_layer == 5 and "min_reserved_pages=5" in r2.reasons[0]
    assert not r1.risky and r1.pages_per_layer == 141


def test_prealloc_off_is_not_risky() -> None:
    b = parse_banner(ENGINE2.replace("enable_prealloc=1", "enable_prealloc=0"))
    assert b is not None and not assess_risk(b).risky


def test_headroom_underflow_flagged() -> None:
    b = parse_banner(ENGINE1)
    assert b is not None
    r = assess_risk(b, gpu_utilization=0.95, device_free_fraction=0.02)
    assert r.risky and "headroom" in r.reasons[0]


def test_multiple_groups_and_noise() -> None:
    lines = ["noise", ENGINE1.replace("group_id=0", "group_id=1"), "Init C++ PageAllocator: garbage", ENGINE2]
    banners = parse_banners(lines)
    assert [b.group_id for b in banners] == [1, 0]
    assert [b.line_no for b in banners] == [2, 4]


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=400))
def test_fuzz_never_raises(text: str) -> None:
    b = parse_banner("Init C++ PageAllocator:" + text)
    if b is not None:
        assess_risk(b)


def test_wrapped_banner_as_quoted_in_the_seed() -> None:
    # Exactly as issue #371 quotes engine 2 (wrapped over three lines), then a log line.
    lines = [
        "(EngineCore) INFO ... [core.py:283] init engine (profile, create kv cache, warmup model) took 10.58 seconds",
        "Init C++ PageAllocator: num_layers=28, mem_size_per_layer=11MB, total_mem_size=667MB,",
        "  page_size=2MB, world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1,",
        "  enable_prealloc=1, num_kv_buffers=2, group_id=0, min_reserved_pages=5, max_reserved_pages=5",
        "(APIServer) INFO:     Application startup complete.",
    ]
    [b] = parse_banners(lines)
    assert (b.line_no, b.num_layers, b.total_mem_size_mb, b.page_size_mb) == (2, 28, 667, 2)
    assert b.enable_prealloc and b.min_reserved_pages == 5 and b.max_reserved_pages == 5
    assert assess_risk(b).risky


def test_wrapped_banner_does_not_swallow_the_next_banner() -> None:
    lines = [
        "Init C++ PageAllocator: num_layers=4, mem_size_per_layer=64MB, total_mem_size=512MB,",
        "Init C++ PageAllocator: num_layers=4, mem_size_per_layer=64MB, page_size=2MB, enable_prealloc=1, group_id=1",
    ]
    banners = parse_banners(lines)
    assert [b.group_id for b in banners] == [1]   # the first one never completes
