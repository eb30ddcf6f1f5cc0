"""Pure-Python twin of the native allocators.

It has the observable semantics the native allocators show when their prealloc worker is idle
(``wait_prealloc_idle()`` after every call): the same page ids in the same order, the same list
sizes, the same errors. The prealloc "worker" runs synchronously inside the call that triggers it,
so the twin never waits and never deadlocks. Memory is modelled, not mapped.
"""

from __future__ import annotations

import math
import re
from collections import deque

from kvdiag.allocator.protocol import BoolCallback, MapCallback

_MB = 1024 * 1024
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
_OS_PAGE = 4096


def _require(ok: bool, param: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{param}: {msg}")


class ReferenceAllocator:
    """Synchronous model of the stock/fixed page allocators (see the module docstring)."""

    kind = "reference"

    def __init__(
        self,
        num_layers: int,
        mem_size_per_layer: int,
        page_size: int,
        *,
        # The native allocators' keywords and defaults (AllocatorConfig, csrc/common.hpp); the last is the twin's.
        world_size: int = 1,
        pp_rank: int = 0,
        async_sched: bool = False,
        contiguous_layout: bool = True,
        enable_prealloc: bool = True,
        num_kv_buffers: int = 2,
        group_id: int = 0,
        min_reserved_pages: int = 5,
        max_reserved_pages: int = 10,
        gpu_utilization: float = 0.95,
        ipc_name: str = "",
        backend: str = "host",
        device_name: str = "kvdiag0",
        device_size: int = 96 << 30,
        map_latency_us: int = 0,
        host_full_commit: bool = False,
        cuda_device: int = 0,
        allow_partial_page: bool = False,  # True: floor mem_size_per_layer / page_size as kvcached does
        print_banner: bool = True,
        wait_timeout_ms: int = 100,
        map_timeout_ms: int = 10000,
        stop_timeout_ms: int = 5000,
        backoff_ms: int = 5,
        device_used_bytes: int = 0,  # bytes others hold on the modelled device (natively: its shared account)
    ) -> None:
        _require(num_layers > 0, "num_layers", f"must be positive, got {num_layers}")
        _require(mem_size_per_layer > 0, "mem_size_per_layer", f"must be positive, got {mem_size_per_layer}")
        _require(page_size > 0, "page_size", f"must be positive, got {page_size}")
        _require(page_size <= mem_size_per_layer, "page_size", "is larger than mem_size_per_layer")
        _require(allow_partial_page or mem_size_per_layer % page_size == 0, "page_size",
                 "must divide mem_size_per_layer")
        _require(num_kv_buffers in (1, 2), "num_kv_buffers", f"must be 1 or 2, got {num_kv_buffers}")
        _require(world_size >= 1, "world_size", f"must be >= 1, got {world_size}")
        _require(pp_rank >= 0, "pp_rank", f"must be >= 0, got {pp_rank}")
        _require(group_id >= 0, "group_id", f"must be >= 0, got {group_id}")
        _require(min_reserved_pages >= 0, "min_reserved_pages", "must be >= 0")
        _require(max_reserved_pages >= 0, "max_reserved_pages", "must be >= 0")
        _require(min_reserved_pages <= max_reserved_pages, "min_reserved_pages",
                 f"must be <= max_reserved_pages ({min_reserved_pages} > {max_reserved_pages})")
        _require(not math.isnan(gpu_utilization) and 0.0 < gpu_utilization <= 1.0, "gpu_utilization",
                 f"must be in (0, 1], got {gpu_utilization}")
        _require(backend in ("host", "cuda"), "backend", f"must be 'host' or 'cuda', got {backend!r}")
        _require(bool(_NAME_RE.match(device_name)) and device_name not in (".", ".."), "device_name",
                 f"must be 1-100 characters of [A-Za-z0-9._-], got {device_name!r}")
        _require(device_size > 0, "device_size", "must be positive")
        _require(map_latency_us >= 0, "map_latency_us", "must be >= 0")
        for name, value in (("wait_timeout_ms", wait_timeout_ms), ("map_timeout_ms", map_timeout_ms),
                            ("stop_timeout_ms", stop_timeout_ms), ("backoff_ms", backoff_ms)):
            _require(value > 0, name, "must be positive")
        if backend == "host":
            _require(page_size % _OS_PAGE == 0, "page_size",
                     f"must be a multiple of the OS page size ({_OS_PAGE}) for the host backend")

        self._num_layers = num_layers
        self._mem_size_per_layer = mem_size_per_layer
        self._page_size = page_size
        self._world_size = world_size
        self._contiguous = contiguous_layout
        self._num_kv_buffers = num_kv_buffers
        self._utilization = gpu_utilization
        self._device_size = device_size
        self._device_used_bytes = device_used_bytes
        self._prealloc = enable_prealloc
        self._max_pages = mem_size_per_layer // page_size
        self._min_reserved = min(self._max_pages, min_reserved_pages)
        self._max_reserved = min(self._max_pages, max_reserved_pages)
        self._num_free = self._max_pages
        self._num_total = self._max_pages
        self._free: deque[int] = deque(range(self._max_pages))
        self._reserved: deque[int] = deque()
        self._reclaimed: list[int] = []
        self._in_use: set[int] = set()
        self._mapped: set[int] = set()
        self._running = False
        self._map_cb: MapCallback | None = None
        self._unmap_cb: MapCallback | None = None
        self._use_worker_ipc = False
        self._counters = {k: 0 for k in ("waits", "wait_timeouts", "sync_fallbacks", "inflight_pages", "map_calls",
                                          "map_ns_total", "map_ns_max", "map_failures", "unmap_calls", "backoffs",
                                          "alloc_timeouts")}
        total = num_kv_buffers * num_layers * mem_size_per_layer
        self._banner = (
            f"Init C++ PageAllocator: num_layers={num_layers}, mem_size_per_layer={mem_size_per_layer // _MB}MB, "
            f"total_mem_size={total // _MB}MB, page_size={page_size // _MB}MB, world_size={world_size}, "
            f"pp_rank={pp_rank}, async_sched={int(async_sched)}, contiguous_layout={int(contiguous_layout)}, "
            f"enable_prealloc={int(enable_prealloc)}, num_kv_buffers={num_kv_buffers}, group_id={group_id}, "
            f"min_reserved_pages={self._min_reserved}, max_reserved_pages={self._max_reserved}"
        )
        if print_banner:
            print(self._banner, flush=True)

    # ---- properties -----------------------------------------------------------------------
    @property
    def banner(self) -> str:
        """kvcached's ``Init C++ PageAllocator`` line for this configuration."""
        return self._banner

    @property
    def min_reserved_pages(self) -> int:
        """min_reserved_pages after clamping to the pool size."""
        return self._min_reserved

    @property
    def max_reserved_pages(self) -> int:
        """max_reserved_pages after clamping to the pool size."""
        return self._max_reserved

    # ---- worker ---------------------------------------------------------------------------
    def start_prealloc_thread(self) -> None:
        """Start the (synchronous) worker and trigger it once, like kvcached."""
        if not self._prealloc or self._running:
            return
        self._running = True
        self._run_worker()

    def stop_prealloc_thread(self) -> None:
        """Stop the worker; reserved pages stay reserved."""
        self._running = False

    def trigger_preallocation(self) -> None:
        """Ask the worker to top the reserve up to min_reserved_pages."""
        self._wake_worker()

    def wait_prealloc_idle(self, timeout_s: float = 10.0) -> bool:
        """The twin's worker is always idle between calls."""
        return True

    def _wake_worker(self) -> None:
        if self._prealloc and self._running:
            self._run_worker()

    def _run_worker(self) -> None:
        to_reserve = max(0, self._min_reserved - len(self._reserved))
        to_reserve = min(to_reserve, len(self._free), self.get_avail_physical_pages())
        if to_reserve <= 0:
            return
        batch = [self._free.popleft() for _ in range(to_reserve)]
        try:
            self._map(batch)
        except RuntimeError:
            self._free.extendleft(reversed(batch))
            return
        self._reserved.extend(batch)

    # ---- allocation -----------------------------------------------------------------------
    def alloc_page(self) -> int:
        """Reserved page if any (fast path), else map a free page (slow path)."""
        if self._reserved:
            page_id = self._reserved.popleft()
            self._num_free -= 1
            self._in_use.add(page_id)
            if len(self._reserved) < self._min_reserved:
                self._wake_worker()
            return page_id
        if not self._free:
            if self._num_free <= 0:
                raise RuntimeError("No free pages left")
            raise RuntimeError("Inconsistent page allocator state: no free pages in the lists but num_free_pages_ > 0")
        page_id = self._free.popleft()
        self._num_free -= 1
        self._in_use.add(page_id)
        if self._prealloc:
            self._counters["sync_fallbacks"] += 1
        try:
            self._map([page_id])
        except RuntimeError:
            self._in_use.discard(page_id)
            self._free.appendleft(page_id)
            self._num_free += 1
            raise
        self._wake_worker()
        return page_id

    def _check_allocated(self, page_id: int) -> None:
        if not 0 <= page_id < self._max_pages:
            raise ValueError(f"page_id: out of range: {page_id}")
        if page_id not in self._in_use:
            raise ValueError(f"page_id: page {page_id} is not allocated")

    def free_page(self, page_id: int) -> None:
        """Return one page (kept as reserve up to max_reserved_pages, else unmapped)."""
        self.free_pages([page_id])

    def free_pages(self, page_ids: list[int]) -> None:
        """Return pages; they top the reserve up to max_reserved_pages and the rest are unmapped."""
        seen: set[int] = set()
        for page_id in page_ids:
            self._check_allocated(page_id)
            if page_id in seen:
                raise ValueError(f"page_ids: duplicate page {page_id}")
            seen.add(page_id)
        self._num_free += len(page_ids)
        to_unmap: list[int] = []
        for page_id in page_ids:
            self._in_use.discard(page_id)
            if len(self._reserved) < self._max_reserved:
                self._reserved.append(page_id)
            else:
                to_unmap.append(page_id)
        if to_unmap:
            self._unmap(to_unmap)
            self._free.extend(to_unmap)

    def resize(self, new_mem_size: int) -> bool:
        """Grow or shrink the pool to new_mem_size // page_size pages; False if impossible."""
        if new_mem_size < 0:
            raise ValueError("new_mem_size: must be >= 0")
        new_pages = new_mem_size // self._page_size
        if new_pages > self._max_pages:
            return False
        if new_pages < self._num_total - self._num_free:
            return False
        if new_pages == self._num_total:
            return True
        if new_pages > self._num_total:
            grow = new_pages - self._num_total
            if len(self._reclaimed) < grow:
                return False
            for _ in range(grow):
                self._free.append(self._reclaimed.pop())
            self._num_free += grow
            self._num_total = new_pages
            return True
        shrink = self._num_total - new_pages
        if len(self._free) + len(self._reserved) < shrink:
            return False
        left = shrink
        while left > 0 and self._free:
            self._reclaimed.append(self._free.pop())
            left -= 1
        to_unmap: list[int] = []
        while left > 0:
            to_unmap.append(self._reserved.pop())
            left -= 1
        self._num_free -= shrink
        self._num_total = new_pages
        if to_unmap:
            self._unmap(to_unmap)
            self._reclaimed.extend(to_unmap)
        return True

    def trim(self) -> None:
        """Unmap every reserved page back to the free list."""
        pages = list(self._reserved)
        self._reserved.clear()
        if pages:
            self._unmap(pages)
            self._free.extend(pages)

    # ---- mapping model --------------------------------------------------------------------
    def _page_bytes(self) -> int:
        return self._page_size * self._num_layers * self._num_kv_buffers

    def _offsets(self, page_ids: list[int]) -> list[int]:
        step = self._page_bytes() if self._contiguous else self._page_size
        return [pid * step for pid in page_ids]

    def _map(self, page_ids: list[int]) -> None:
        self._counters["map_calls"] += 1
        if (self._world_size > 1 or self._use_worker_ipc) and self._map_cb is not None:
            self._map_cb(self._world_size, self._offsets(page_ids))
            return
        need = len([p for p in page_ids if p not in self._mapped]) * self._page_bytes()
        if self._device_used() + need > self._device_size:
            self._counters["map_failures"] += 1
            raise RuntimeError("Failed to map pages to KV tensors: out of device memory")
        self._mapped.update(page_ids)

    def _unmap(self, page_ids: list[int]) -> None:
        self._counters["unmap_calls"] += 1
        if (self._world_size > 1 or self._use_worker_ipc) and self._unmap_cb is not None:
            self._unmap_cb(self._world_size, self._offsets(page_ids))
            return
        self._mapped.difference_update(page_ids)

    def _device_used(self) -> int:
        return self._device_used_bytes + len(self._mapped) * self._page_bytes()

    # ---- getters --------------------------------------------------------------------------
    def get_num_free_pages(self) -> int:
        """Pages not in use (free list + reserve + in flight)."""
        return self._num_free

    def get_num_inuse_pages(self) -> int:
        """Pages handed out by alloc_page and not yet freed."""
        return self._num_total - self._num_free

    def get_num_total_pages(self) -> int:
        """Current pool size in pages (changes with resize)."""
        return self._num_total

    def get_num_reserved_pages(self) -> int:
        """Pre-mapped pages ready for the fast path."""
        return len(self._reserved)

    def get_num_inflight_pages(self) -> int:
        """Pages counted free but in neither list (always 0 in the synchronous twin)."""
        return self._num_free - len(self._free) - len(self._reserved)

    def get_num_mapped_pages(self) -> int:
        """Page ids with physical memory behind them."""
        return len(self._mapped)

    def get_avail_physical_pages(self) -> int:
        """Pages that fit under the utilization cap (saturating, like the fixed allocator)."""
        free = max(0, self._device_size - self._device_used())
        headroom = int(float(self._device_size) * (1.0 - self._utilization))
        usable = free - headroom if free > headroom else 0
        return usable // self._page_bytes()

    # ---- callbacks ------------------------------------------------------------------------
    def set_broadcast_map_callback(self, callback: MapCallback | None) -> None:
        """Route maps through ``callback(world_size, offsets)`` when worker IPC is on."""
        self._map_cb = callback

    def set_broadcast_unmap_callback(self, callback: MapCallback | None) -> None:
        """Route unmaps through ``callback(world_size, offsets)`` when worker IPC is on."""
        self._unmap_cb = callback

    def set_should_use_worker_ipc_callback(self, callback: BoolCallback | None) -> None:
        """Ask ``callback`` once and cache the answer (fixed semantics)."""
        self._use_worker_ipc = bool(callback()) if callback is not None else False

    def set_use_worker_ipc(self, value: bool) -> None:
        """Set the worker-IPC decision directly."""
        self._use_worker_ipc = bool(value)

    def counters(self) -> dict[str, int]:
        """Counters with the native allocators' keys (waits and timeouts are always 0 here)."""
        out = dict(self._counters)
        out["inflight_pages"] = self.get_num_inflight_pages()
        return out
