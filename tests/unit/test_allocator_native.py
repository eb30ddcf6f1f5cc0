"""Behaviour of the native allocators that the twin comparison cannot show: bad input, the #377
underflow, bounded waits, GIL release, callback threading, cross-process back-off."""

from __future__ import annotations

import ctypes.util
import math
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import pytest

from kvdiag import _native as native  # built by the package: a missing build fails, never skips
from kvdiag.allocator import kvcached_env_kwargs, make_allocator
from kvdiag.allocator.protocol import PageAllocator
from kvdiag.errors import AllocatorError

MB = 1024 * 1024
PAGE = 64 * 1024


def _dev() -> str:
    return f"kvdiag-ut-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _small(kind: str, **kw: object) -> PageAllocator:
    args: dict[str, object] = dict(num_layers=2, mem_size_per_layer=8 * PAGE, page_size=PAGE, device_name=_dev(),
                                   print_banner=False)
    args.update(kw)
    return make_allocator(kind, **args)


def _poll(pred: object, timeout_s: float = 10.0) -> bool:
    """Bounded poll of a zero-argument predicate."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def held_lock() -> Iterator[tuple[str, object]]:
    """A device whose VMM lock is held by this test (another "process" mid-VMM)."""
    dev = _dev()
    lock = native.DeviceVmmLock(dev)
    assert lock.acquire(5.0)
    try:
        yield dev, lock
    finally:
        if lock.held:
            lock.release()


@pytest.mark.parametrize("kind", ["stock", "fixed", "reference"])
@pytest.mark.parametrize(
    ("bad", "param"),
    [
        ({"page_size": 0}, "page_size"),
        ({"page_size": 3 * PAGE}, "page_size"),
        ({"min_reserved_pages": 6, "max_reserved_pages": 5}, "min_reserved_pages"),
        ({"gpu_utilization": 0.0}, "gpu_utilization"),
        ({"gpu_utilization": 1.5}, "gpu_utilization"),
        ({"gpu_utilization": math.nan}, "gpu_utilization"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_bad_input_raises_value_error_naming_parameter(kind: str, bad: dict[str, object], param: str) -> None:
    before = _threads()
    with pytest.raises(ValueError) as info:
        _small(kind, **bad)
    assert str(info.value).startswith(param + ":"), str(info.value)
    assert _threads() == before  # nothing left running


def test_stock_prints_kvcached_banner(capfd: pytest.CaptureFixture[str]) -> None:
    a = make_allocator("stock", num_layers=28, mem_size_per_layer=12_490_000, page_size=2 * MB, async_sched=True,
                       allow_partial_page=True, device_name=_dev())
    out = capfd.readouterr().out
    seed = ("Init C++ PageAllocator: num_layers=28, mem_size_per_layer=11MB, total_mem_size=667MB, page_size=2MB, "
            "world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1, enable_prealloc=1, num_kv_buffers=2, "
            "group_id=0, min_reserved_pages=5, max_reserved_pages=5")
    assert out.splitlines() == [seed]
    assert a.banner == seed
    ref = make_allocator("reference", num_layers=28, mem_size_per_layer=12_490_000, page_size=2 * MB,
                         async_sched=True, allow_partial_page=True, print_banner=False)
    assert ref.banner == seed


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is installed here")
@pytest.mark.parametrize("kind", ["stock", "fixed"])
def test_cuda_backend_without_driver_is_a_clear_error(kind: str) -> None:
    before = _threads()
    with pytest.raises(native.BackendUnavailable, match="libcuda.so.1"):
        _small(kind, backend="cuda", page_size=2 * MB, mem_size_per_layer=8 * MB)
    assert issubclass(native.BackendUnavailable, RuntimeError)
    assert _threads() == before


def test_headroom_underflow_377_only_in_stock() -> None:
    dev = _dev()
    size = 10 << 30
    # 100 MB free on a 10 GiB device: less than the 5 % headroom (512 MB).
    native.register_device_usage(dev, size - 100 * MB)
    try:
        stock = _small("stock", device_name=dev, device_size=size)
        fixed = _small("fixed", device_name=dev, device_size=size)
        ref = _small("reference", device_size=size, device_used_bytes=size - 100 * MB)
        assert stock.get_avail_physical_pages() > 10**9  # wrapped size_t
        assert fixed.get_avail_physical_pages() == 0
        assert ref.get_avail_physical_pages() == 0
        fixed.start_prealloc_thread()
        assert fixed.wait_prealloc_idle(10.0)
        assert fixed.get_num_reserved_pages() == 0  # the guard engages: no reserve under pressure
        fixed.stop_prealloc_thread()
    finally:
        native.register_device_usage(dev, 0)


def test_fixed_reserve_backs_off_while_device_lock_is_held_elsewhere(held_lock: tuple[str, object]) -> None:
    dev, lock = held_lock
    a = _small("fixed", device_name=dev, min_reserved_pages=3, max_reserved_pages=4, backoff_ms=2)
    a.start_prealloc_thread()
    assert _poll(lambda: a.counters()["backoffs"] > 0)
    assert a.get_num_reserved_pages() == 0
    assert a.get_num_inflight_pages() == 0  # backing off keeps the pages on the free list
    lock.release()  # type: ignore[attr-defined]
    assert _poll(lambda: a.get_num_reserved_pages() == 3)
    a.stop_prealloc_thread()


def test_fixed_sync_map_times_out_with_clear_error(held_lock: tuple[str, object]) -> None:
    dev, _lock = held_lock
    a = _small("fixed", device_name=dev, enable_prealloc=False, map_timeout_ms=200)
    with pytest.raises(native.AllocatorTimeout, match="map_timeout_ms=200"):
        a.alloc_page()
    assert isinstance(native.AllocatorTimeout("x"), RuntimeError)
    c = a.counters()
    assert c["map_failures"] == 1
    assert a.get_num_free_pages() == 8 and a.get_num_inuse_pages() == 0  # the page went back


def test_fixed_alloc_page_releases_the_gil_while_it_waits(held_lock: tuple[str, object]) -> None:
    dev, lock = held_lock
    a = _small("fixed", device_name=dev, map_timeout_ms=60_000)  # prealloc on, worker not started
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(a.alloc_page()), daemon=True)
    t.start()
    # This loop runs Python while the other thread is inside alloc_page: only possible because the
    # binding released the GIL. The map cannot finish while the test holds the device lock.
    assert _poll(lambda: a.counters()["sync_fallbacks"] == 1)
    assert t.is_alive() and not got
    lock.release()  # type: ignore[attr-defined]
    t.join(30)
    assert got == [0]


def _alloc_in_threads(a: PageAllocator, n: int) -> tuple[list[threading.Thread], list[int], list[BaseException]]:
    got: list[int] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            got.append(a.alloc_page())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, got, errors


def test_fixed_concurrent_synchronous_maps_are_combined(held_lock: tuple[str, object]) -> None:
    dev, lock = held_lock
    a = _small("fixed", device_name=dev, map_timeout_ms=60_000)  # prealloc on, worker not started
    threads, got, errors = _alloc_in_threads(a, 4)
    # Every caller has taken a free page and queued it (GIL released); the first leads a map that
    # waits for the device lock the test holds.
    assert _poll(lambda: a.counters()["sync_fallbacks"] == 4)
    lock.release()  # type: ignore[attr-defined]
    for t in threads:
        t.join(30)
    assert not errors and sorted(got) == [0, 1, 2, 3]
    c = a.counters()
    # The leader's own page, then the three that queued meanwhile in ONE backend call.
    assert (c["map_calls"], c["pages_mapped"], c["combined_maps"]) == (2, 4, 1)
    assert a.get_num_mapped_pages() == 4 and a.get_num_inuse_pages() == 4


def test_fixed_queued_callers_time_out_and_return_their_pages(held_lock: tuple[str, object]) -> None:
    dev, _lock = held_lock
    a = _small("fixed", device_name=dev, map_timeout_ms=300, wait_timeout_ms=50)
    threads, got, errors = _alloc_in_threads(a, 3)
    for t in threads:
        t.join(30)
    assert not got and len(errors) == 3
    assert all(isinstance(e, native.AllocatorTimeout) for e in errors), errors
    assert a.get_num_free_pages() == 8 and a.get_num_inuse_pages() == 0 and a.get_num_inflight_pages() == 0
    assert a.get_num_mapped_pages() == 0


def test_fixed_caller_gives_up_on_a_stalled_combined_map_and_its_page_is_kept() -> None:
    calls: list[int] = []
    entered = [threading.Event(), threading.Event()]
    release = [threading.Event(), threading.Event()]

    def slow_map(world_size: int, offsets: Sequence[int]) -> None:
        i = len(calls)
        calls.append(len(offsets))
        entered[min(i, 1)].set()
        release[min(i, 1)].wait(60)

    a = _small("fixed", map_timeout_ms=3000, wait_timeout_ms=50)  # prealloc on, worker not started
    a.set_use_worker_ipc(True)
    a.set_broadcast_map_callback(slow_map)
    threads, got, errors = _alloc_in_threads(a, 3)
    try:
        assert entered[0].wait(10)  # the first caller leads; its map is stuck in the callback
        assert _poll(lambda: a.counters()["sync_fallbacks"] == 3)  # the other two queued behind it
        release[0].set()
        assert entered[1].wait(10)  # the next leader maps both queued pages in one call
        assert calls == [1, 2]
        # The caller whose page is in that stuck call gives up at its deadline (~3 s)...
        assert _poll(lambda: len(errors) == 1, timeout_s=30)
        assert isinstance(errors[0], native.AllocatorTimeout), errors
        assert a.get_num_inflight_pages() == 1  # ...and its page is free again, but still in flight
    finally:
        release[1].set()
    for t in threads:
        t.join(30)
    assert len(set(got)) == 2
    # The stuck map finished: the abandoned page was mapped, so it joins the reserve.
    assert _poll(lambda: a.get_num_inflight_pages() == 0)
    assert a.get_num_reserved_pages() == 1 and a.get_num_inuse_pages() == 2
    assert a.counters()["alloc_timeouts"] == 1


def test_fixed_alloc_page_times_out_when_the_worker_map_stalls() -> None:
    release = threading.Event()
    entered = threading.Event()

    def stalled_map(world_size: int, offsets: Sequence[int]) -> None:
        entered.set()
        release.wait(30)

    a = make_allocator("fixed", num_layers=2, mem_size_per_layer=PAGE, page_size=PAGE, device_name=_dev(),
                       min_reserved_pages=1, max_reserved_pages=1, map_timeout_ms=300, wait_timeout_ms=50,
                       print_banner=False)
    a.set_use_worker_ipc(True)
    a.set_broadcast_map_callback(stalled_map)
    a.start_prealloc_thread()
    try:
        assert entered.wait(10)
        assert a.get_num_inflight_pages() == 1  # visible, not "out of pages"
        with pytest.raises(native.AllocatorTimeout, match="in flight"):
            a.alloc_page()
        c = a.counters()
        assert c["waits"] == 1 and c["wait_timeouts"] >= 1 and c["alloc_timeouts"] == 1
    finally:
        release.set()
    assert _poll(lambda: a.get_num_reserved_pages() == 1)
    assert a.alloc_page() == 0
    a.stop_prealloc_thread()


def test_fixed_stop_is_bounded_when_a_map_never_returns() -> None:
    release = threading.Event()
    entered = threading.Event()

    def stuck_map(world_size: int, offsets: Sequence[int]) -> None:
        entered.set()
        release.wait(60)

    a = _small("fixed", stop_timeout_ms=200)
    a.set_use_worker_ipc(True)
    a.set_broadcast_map_callback(stuck_map)
    a.start_prealloc_thread()
    assert entered.wait(10)
    a.stop_prealloc_thread()  # returns after stop_timeout_ms although the worker is still mapping
    assert not release.is_set()
    release.set()
    assert _poll(lambda: a.get_num_inflight_pages() == 0)


@pytest.mark.parametrize("kind", ["stock", "fixed"])
def test_map_callback_may_call_back_into_the_allocator(kind: str) -> None:
    a = _small(kind, enable_prealloc=False)
    seen: list[tuple[int, list[int], dict[str, int]]] = []
    a.set_use_worker_ipc(True)
    # Re-entering the allocator from the callback only works because no allocator lock is held.
    a.set_broadcast_map_callback(lambda ws, offs: seen.append((ws, list(offs), a.counters())))
    assert a.alloc_page() == 0
    assert a.alloc_page() == 1
    assert [s[:2] for s in seen] == [(1, [0]), (1, [2 * 2 * PAGE])]  # contiguous: pid * page * layers * 2


@pytest.mark.parametrize("kind", ["fixed", "reference"])
def test_should_use_worker_ipc_is_asked_once_on_the_callers_thread(kind: str) -> None:
    callers: list[int] = []

    def should() -> bool:
        callers.append(threading.get_ident())
        return True

    maps: list[int] = []
    a = _small(kind, enable_prealloc=False)
    a.set_broadcast_map_callback(lambda ws, offs: maps.append(len(offs)))
    a.set_should_use_worker_ipc_callback(should)
    for _ in range(3):
        a.alloc_page()
    assert callers == [threading.get_ident()]
    assert maps == [1, 1, 1]


def test_stock_asks_should_use_worker_ipc_on_every_map() -> None:
    calls: list[int] = []
    a = _small("stock", enable_prealloc=False)
    a.set_should_use_worker_ipc_callback(lambda: calls.append(1) is None)
    a.set_broadcast_map_callback(lambda ws, offs: None)
    for _ in range(3):
        a.alloc_page()
    assert len(calls) == 3


def test_fixed_map_callback_error_is_raised_and_page_returned() -> None:
    def broken(world_size: int, offsets: Sequence[int]) -> None:
        raise ValueError("worker 0 refused the map")

    a = _small("fixed", enable_prealloc=False)
    a.set_use_worker_ipc(True)
    a.set_broadcast_map_callback(broken)
    with pytest.raises(RuntimeError, match="ValueError: worker 0 refused the map"):
        a.alloc_page()
    assert a.get_num_free_pages() == 8
    assert a.counters()["map_failures"] == 1


@pytest.mark.parametrize("kind", ["stock", "fixed"])
def test_host_backend_maps_and_unmaps_real_pages(kind: str) -> None:
    a = _small(kind, enable_prealloc=False, min_reserved_pages=0, max_reserved_pages=1)
    pages = [a.alloc_page() for _ in range(4)]
    assert a.get_num_mapped_pages() == 4
    a.free_pages(pages)  # one stays reserved (mapped), three are unmapped
    assert a.get_num_mapped_pages() == 1
    assert a.get_num_reserved_pages() == 1
    a.trim()
    assert a.get_num_mapped_pages() == 0
    with pytest.raises(RuntimeError, match="No free pages left"):
        b = _small(kind, enable_prealloc=False, mem_size_per_layer=PAGE)
        b.alloc_page()
        b.alloc_page()


def test_native_stress_entry_point_is_consistent() -> None:
    r = native.stress(kind="fixed", threads=3, ops=20000, device_name=_dev())
    assert r["errors"] == 0 and r["double_allocs"] == 0
    assert r["final_free"] == r["final_total"] and r["final_inflight"] == 0


def test_make_allocator_errors() -> None:
    with pytest.raises(AllocatorError):
        make_allocator("bogus", num_layers=1, mem_size_per_layer=PAGE, page_size=PAGE)
    with pytest.raises(TypeError, match="page_size"):
        make_allocator("fixed", num_layers=1, mem_size_per_layer=PAGE)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        make_allocator("fixed", num_layers=1, mem_size_per_layer=PAGE, page_size=PAGE, bogus=1)


def test_kvcached_env_kwargs() -> None:
    env = {"KVCACHED_PAGE_PREALLOC_ENABLED": "True", "KVCACHED_MIN_RESERVED_PAGES": "3",
           "KVCACHED_MAX_RESERVED_PAGES": "7", "KVCACHED_GPU_UTILIZATION": "0.9", "KVCACHED_PAGE_SIZE_MB": "4",
           "KVCACHED_CONTIGUOUS_LAYOUT": "false"}
    assert kvcached_env_kwargs(env) == {"enable_prealloc": True, "min_reserved_pages": 3, "max_reserved_pages": 7,
                                        "gpu_utilization": 0.9, "page_size": 4 * MB, "contiguous_layout": False}
    assert kvcached_env_kwargs({"KVCACHED_PAGE_PREALLOC_ENABLED": "1"}) == {"enable_prealloc": False}
    assert kvcached_env_kwargs({}) == {}


@pytest.mark.parametrize("kind", ["stock", "fixed", "reference"])
def test_free_pages_rejects_bad_batches_without_changing_state(kind: str) -> None:
    a = _small(kind, enable_prealloc=False)
    p0, p1 = a.alloc_page(), a.alloc_page()
    for batch, message in (([p0, p1, p0], f"page_ids: duplicate page {p0}"),
                           ([p0, 7], "page_id: page 7 is not allocated"),
                           ([p1, 99], "page_id: out of range: 99")):
        with pytest.raises(ValueError) as info:
            a.free_pages(batch)
        assert str(info.value) == message
        assert a.get_num_inuse_pages() == 2  # nothing was freed
    a.free_pages([p1, p0])
    assert a.get_num_inuse_pages() == 0
