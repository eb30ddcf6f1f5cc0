"""kvdiag's kvcached-shaped hook for a real vLLM engine (a ``vllm.general_plugins`` entry point).

vLLM loads general plugins in every one of its processes (API server, EngineCore, Worker, and any
other `vllm` command). This one is inert unless ``KVDIAG_VLLM_ALLOCATOR`` is ``stock`` or ``fixed``, and
then acts only in the EngineCore (and in the one worker ``KVDIAG_VLLM_HANG_RANK`` names), where kvcached
acts (../shared/design/kvcached-facts.md section 3):

1. vLLM's ``BlockPool.__init__`` is where kvcached's ElasticBlockPool builds its KVCacheManager: the
   hook builds kvdiag's page allocator there (kind from KVDIAG_VLLM_ALLOCATOR, host backend on the
   run's modelled device, geometry from KVDIAG_VLLM_* and the KVCACHED_* variables), which prints
   the ``Init C++ PageAllocator`` banner, registers a Python ``should_use_worker_ipc`` callback
   (kvcached always does; the stock allocator calls it from its prealloc worker), starts the
   prealloc thread and allocates the null block with ``alloc_page`` on the EngineCore main thread.
2. Request blocks are served through it: each vLLM block is backed by pages of the pool (vLLM's
   whole KV cache spread over the pool); a page is allocated when its first block is handed out
   (``get_new_blocks``, ``touch``) and freed when its last block is released (``free_blocks``).

With the stock allocator and the seed's engine-2 pool (5 pages == min_reserved_pages) step 1 hangs
for real in the GIL cycle of kvcached issue #371; with the fixed one the engine starts and serves.
``KVDIAG_VLLM_STALL_AFTER_S=T`` (optional) injects that same start-up path once, T seconds into
serving, on the EngineCore main thread: a runtime stall whose cause is known.
``KVDIAG_VLLM_STALL_WHEN=PATH`` with it (optional) holds that stall back until the file PATH exists as well,
so a driver can serve measured requests first and inject the stall when it is done.
``KVDIAG_VLLM_STEP_DELAY_MS=D`` (optional) makes each EngineCore step with requests D ms longer, the step
time of a real model (a tiny one steps faster than the API server can stream, so nothing queues in it).

With ``KVDIAG_VLLM_HANG_RANK=R`` as well, the stall goes into one worker instead: the worker of rank R
(tensor-parallel rank R of a TP-only engine) builds the stock engine-2 pool on its main thread in the
first forward pass at least T seconds after its first one (which compiles kernels), and hangs there in the same GIL
cycle; the other ranks then wait for it in their next collective, and the EngineCore waits for the
answering rank on vLLM's shared-memory ring. The EngineCore itself does not stall then.
``KVDIAG_VLLM_RANK_BRANCH=barrier`` with those two makes that rank take a rank-local branch instead of the
GIL cycle: in the first pass of a new request at least T seconds after its first one, it calls a barrier on
its tensor-parallel group that no other rank calls, while the others go on into the forward pass's
all-reduce (the ranks then wait for each other in different collectives).

With ``KVDIAG_AGENT=1`` every vLLM process also arms kvdiag's in-process agent (:mod:`kvdiag.agent`), so
``kvdiag capture`` reads it where ptrace is refused.

Only the standard library, vLLM, kvdiag.agent and kvdiag.allocator are imported here (this runs inside the
engine; none of kvdiag's pipeline stages belong in it).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from typing import Any

from kvdiag.agent.arm import arm_quietly, load_extension
from kvdiag.agent.protocol import ENABLE_ENV as AGENT_ENV
from kvdiag.allocator import kvcached_env_kwargs, make_allocator

ENABLE_ENV = "KVDIAG_VLLM_ALLOCATOR"
STALL_ENV = "KVDIAG_VLLM_STALL_AFTER_S"
STALL_WHEN_ENV = "KVDIAG_VLLM_STALL_WHEN"
HANG_RANK_ENV = "KVDIAG_VLLM_HANG_RANK"
STEP_DELAY_ENV = "KVDIAG_VLLM_STEP_DELAY_MS"
BRANCH_ENV = "KVDIAG_VLLM_RANK_BRANCH"
MB = 1024 * 1024
GB = 1024 * MB

_log = logging.getLogger("vllm.kvdiag_plugin")
_installed = False


def _env(name: str, default: str) -> str:
    return os.environ.get(name, "") or default


def _in_engine_core() -> bool:
    if multiprocessing.current_process().name.startswith("EngineCore"):
        return True
    try:
        with open("/proc/self/cmdline", "rb") as fh:  # not setproctitle: reading it renames the process
            return fh.read().startswith(b"VLLM::EngineCore")
    except OSError:
        return False


def _worker_rank() -> int | None:
    """The executor rank of this process when it is a vLLM worker (multiprocessing name ``VllmWorker-R``:
    the plugin loads before the worker sets its title)."""
    name = multiprocessing.current_process().name
    if name.startswith("VllmWorker-"):
        try:
            return int(name.rsplit("-", 1)[1])
        except ValueError:
            return None
    return None


def _hang_rank() -> int | None:
    text = os.environ.get(HANG_RANK_ENV, "").strip()
    try:
        return int(text) if text else None
    except ValueError:
        return None


def register() -> None:
    """vLLM's plugin entry point: patch the block pool in the EngineCore when enabled; in the worker of
    rank ``KVDIAG_VLLM_HANG_RANK``, arm the injected stall."""
    global _installed
    if os.environ.get(AGENT_ENV) == "1":
        arm_quietly()   # kvdiag's in-process agent, in every vLLM process (idempotent)
    kind = os.environ.get(ENABLE_ENV, "").strip().lower()
    if kind not in ("stock", "fixed") or _installed:
        return
    rank = _worker_rank()
    if rank is not None:
        if rank == _hang_rank() and os.environ.get(STALL_ENV):
            _arm_worker_stall(rank, float(os.environ[STALL_ENV]))
            _installed = True
        return
    if not _in_engine_core():
        return
    # vLLM exists only inside its own processes, and is heavy: imported once the plugin is enabled
    from vllm.v1.core import block_pool

    _patch(block_pool.BlockPool, kind)
    delay_ms = float(_env(STEP_DELAY_ENV, "0") or 0)
    if delay_ms > 0:
        _arm_step_delay(delay_ms / 1000.0)
    _installed = True
    _log.info("kvdiag plugin: %s page allocator will back the KV block pool (engine %s, pid %d)",
              kind, _env("KVDIAG_VLLM_ENGINE", "?"), os.getpid())


def _native() -> Any:
    """kvdiag._native: importable from the package, else loaded from KVDIAG_NATIVE_PATH."""
    return load_extension("kvdiag._native", "KVDIAG_NATIVE_PATH")


def _always_false() -> bool:
    """kvcached's should_use_worker_ipc at TP=1 in the EngineCore: a Python callable, so calling it needs
    the GIL (the stock allocator calls it from its prealloc worker before each map)."""
    return False


def build_allocator(kind: str, layers: int, mem_size_per_layer: int, ipc_suffix: str = "") -> Any:
    """kvdiag's allocator of ``kind`` as kvcached's KVCacheManager builds its PageAllocator (prints the banner)."""
    _native()  # make kvdiag._native importable before make_allocator asks for it
    kwargs: dict[str, Any] = {
        "num_layers": layers, "mem_size_per_layer": mem_size_per_layer, "page_size": 2 * MB,
        "world_size": 1, "pp_rank": 0, "async_sched": False, "contiguous_layout": True,
        "enable_prealloc": True, "num_kv_buffers": 2, "group_id": 0,
        "backend": "host", "device_name": _env("KVDIAG_VLLM_DEVICE", f"kvdiag-vllm-{os.getpgrp()}"),
        "device_size": int(float(_env("KVDIAG_VLLM_DEVICE_SIZE_GB", "96")) * GB),
        "map_latency_us": int(_env("KVDIAG_VLLM_MAP_LATENCY_US", "0")),
        "ipc_name": _env("KVCACHED_IPC_NAME", f"kvcached_vLLM_{os.getpgrp()}") + ipc_suffix,
        "allow_partial_page": True,  # kvcached floors mem_size_per_layer / page_size (the seed's 11 MB / 2 MB)
    }
    kwargs.update(kvcached_env_kwargs(os.environ))
    sys.stdout.flush()  # the banner comes from C++ on the same stdout: keep the order
    alloc = make_allocator(kind, **kwargs)
    sys.stdout.flush()
    if kind == "stock":
        alloc.set_should_use_worker_ipc_callback(_always_false)
    else:
        alloc.set_use_worker_ipc(False)  # the fix: the answer taken once, no Python call from the worker
    alloc.start_prealloc_thread()
    return alloc


def take_null_block(alloc: Any) -> int:
    """kvcached's ``alloc(1)`` for the null block, right after the pool is built, on this thread.

    On a GPU the engine's CUDA work between the two calls lets the prealloc worker take its first batch
    off the free list before the null block is asked for; on the host backend mapping is instant, so
    wait (bounded, holding the GIL as Python code between the two calls does) until the worker has
    pages in flight or reserved. The switch interval is raised for that moment so an OS preemption of
    this thread cannot hand the GIL to the worker first.
    """
    wait_s = float(_env("KVDIAG_VLLM_WARMUP_WAIT_MS", "200")) / 1000.0
    old = sys.getswitchinterval()
    if wait_s > 0:
        sys.setswitchinterval(0.1)
        deadline = time.perf_counter() + wait_s
        while time.perf_counter() < deadline:
            if alloc.get_num_inflight_pages() > 0 or alloc.get_num_reserved_pages() > 0:
                break
    try:
        return int(alloc.alloc_page())
    finally:
        sys.setswitchinterval(old)


class PoolBacking:
    """vLLM's blocks spread over the allocator's pages; a page is held while any of its blocks is."""

    def __init__(self, alloc: Any, num_blocks: int) -> None:
        self.alloc = alloc
        self.num_blocks = num_blocks
        self.slots = max(1, int(alloc.get_num_total_pages()) - 1)   # pages left after the null block
        self.users: dict[int, int] = {}       # logical page -> blocks holding it
        self.pages: dict[int, int] = {}       # logical page -> allocator page id
        self.backed: set[int] = set()         # block ids currently holding their pages
        self.lock = threading.Lock()

    def _logical(self, block_id: int) -> range:
        n = max(1, self.num_blocks - 1)
        lo = (block_id - 1) * self.slots // n
        hi = max(lo + 1, block_id * self.slots // n)
        return range(lo, min(hi, self.slots))

    def hold(self, block_id: int) -> None:
        if block_id <= 0 or block_id in self.backed:
            return
        with self.lock:
            self.backed.add(block_id)
            for lp in self._logical(block_id):
                n = self.users.get(lp, 0)
                self.users[lp] = n + 1
                if n == 0:
                    self.pages[lp] = int(self.alloc.alloc_page())

    def release(self, block_id: int) -> None:
        if block_id not in self.backed:
            return
        with self.lock:
            self.backed.discard(block_id)
            for lp in self._logical(block_id):
                n = self.users.get(lp, 0) - 1
                if n <= 0:
                    self.users.pop(lp, None)
                    page = self.pages.pop(lp, None)
                    if page is not None:
                        self.alloc.free_page(page)
                else:
                    self.users[lp] = n


def _patch(cls: Any, kind: str) -> None:
    orig_init = cls.__init__
    orig_get = cls.get_new_blocks
    orig_free = cls.free_blocks
    orig_touch = cls.touch
    layers = int(_env("KVDIAG_VLLM_LAYERS", "28"))
    per_layer = int(float(_env("KVDIAG_VLLM_KV_PER_LAYER_MB", "11")) * MB)
    # With a hang rank the stall goes into that worker (see _arm_worker_stall), not here.
    stall_after = os.environ.get(STALL_ENV) if _hang_rank() is None else None
    stall_when = os.environ.get(STALL_WHEN_ENV) or None
    state: dict[str, float | bool] = {"ready_t": 0.0, "stalled": False}

    def __init__(self: Any, num_gpu_blocks: int, *args: Any, **kwargs: Any) -> None:
        orig_init(self, num_gpu_blocks, *args, **kwargs)
        _log.info("kvdiag plugin: building the KV pool for %d blocks: %s allocator, %d layers x %.1f MiB, "
                  "host backend", num_gpu_blocks, kind, layers, per_layer / MB)
        for h in logging.getLogger("vllm").handlers:
            h.flush()
        alloc = build_allocator(kind, layers, per_layer)
        null_page = take_null_block(alloc)
        self._kvdiag_backing = PoolBacking(alloc, num_gpu_blocks)
        _log.info("kvdiag plugin: null block on page %d; %d pages back %d blocks", null_page,
                  alloc.get_num_total_pages(), num_gpu_blocks)
        state["ready_t"] = time.monotonic()

    def _maybe_stall() -> None:
        if stall_after is None or state["stalled"] or not state["ready_t"]:
            return
        if time.monotonic() - float(state["ready_t"]) < float(stall_after):
            return
        if stall_when is not None and not os.path.exists(stall_when):
            return
        state["stalled"] = True
        _log.warning("kvdiag plugin: KVDIAG_VLLM_STALL_AFTER_S=%s: growing the pool by a stock engine-2 pool "
                     "on the EngineCore main thread now", stall_after)
        extra = build_allocator("stock", 28, 11 * MB, ipc_suffix="_STALL")
        take_null_block(extra)

    def get_new_blocks(self: Any, num_blocks: int) -> Any:
        _maybe_stall()
        blocks = orig_get(self, num_blocks)
        backing = getattr(self, "_kvdiag_backing", None)
        if backing is not None:
            for b in blocks:
                backing.hold(b.block_id)
        return blocks

    def touch(self: Any, blocks: Any) -> None:
        orig_touch(self, blocks)
        backing = getattr(self, "_kvdiag_backing", None)
        if backing is not None:
            for b in blocks:
                if b.ref_cnt > 0 and not b.is_null:
                    backing.hold(b.block_id)

    def free_blocks(self: Any, ordered_blocks: Any) -> None:
        blocks = list(ordered_blocks)
        orig_free(self, blocks)
        backing = getattr(self, "_kvdiag_backing", None)
        if backing is not None:
            for b in blocks:
                if b.ref_cnt == 0 and (b.pool is None or b.pool is self):
                    backing.release(b.block_id)

    cls.__init__ = __init__
    cls.get_new_blocks = get_new_blocks
    cls.touch = touch
    cls.free_blocks = free_blocks


def _arm_step_delay(delay_s: float) -> None:
    """Each engine step that has requests to schedule takes ``delay_s`` longer, as a real model's forward pass
    does: a tiny model on a CPU steps faster than the API server streams, so its engine idles between requests
    and its running/waiting gauges read 0 most of the time; with a real step time the engine is the bottleneck
    and requests queue in it. The sleep releases the GIL (the input and output threads keep running)."""
    from vllm.v1.core.sched import scheduler  # vLLM exists only inside its own processes: imported when armed

    cls = scheduler.Scheduler
    orig_schedule = cls.schedule

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(self.running) + len(self.waiting) > 0:
            time.sleep(delay_s)
        return orig_schedule(self, *args, **kwargs)

    cls.schedule = schedule
    _log.info("kvdiag plugin: each engine step with requests takes %.0f ms longer (%s)", delay_s * 1000,
              STEP_DELAY_ENV)


def _arm_worker_stall(rank: int, after_s: float) -> None:
    """Make this worker's first forward pass ``after_s`` seconds after its first one (the worker is warm and
    serving: the first pass compiles kernels) build a stock engine-2 pool on the worker's main thread: the
    GIL cycle, inside vLLM's ``Worker.execute_model``."""
    from vllm.v1.worker import gpu_worker  # vLLM exists only inside its own processes: imported when armed

    cls = gpu_worker.Worker
    orig_execute = cls.execute_model
    state: dict[str, float | bool] = {"served_t": 0.0, "stalled": False}
    branch = os.environ.get(BRANCH_ENV, "").strip() == "barrier"

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        forward = getattr(scheduler_output, "total_num_scheduled_tokens", 0) > 0
        served = float(state["served_t"])
        # The rank-local branch waits for a new request's first pass: the one in flight (the run's warm-up)
        # is answered first, so the branch is taken while serving.
        new_request = bool(getattr(scheduler_output, "scheduled_new_reqs", None)) or not branch
        if forward and served and new_request and not state["stalled"] and time.monotonic() - served >= after_s:
            state["stalled"] = True
            _log.warning("kvdiag plugin: %s=%g %s=%d: growing the pool by a stock engine-2 pool on worker rank "
                         "%d's main thread now (pid %d)", STALL_ENV, after_s, HANG_RANK_ENV, rank, rank, os.getpid())
            for h in logging.getLogger("vllm").handlers:
                h.flush()
            if branch:
                rank_local_barrier()
            extra = build_allocator("stock", 28, 11 * MB, ipc_suffix=f"_RANK{rank}")
            take_null_block(extra)
        out = orig_execute(self, scheduler_output, *args, **kwargs)
        if forward and not served:
            state["served_t"] = time.monotonic()
        return out

    cls.execute_model = execute_model
    _log.info("kvdiag plugin: worker rank %d will stall in its first forward pass %gs after its first one (pid %d)",
              rank, after_s, os.getpid())


def rank_local_barrier() -> None:
    """A collective only this rank calls (a barrier on its tensor-parallel group): the rank-local branch that
    leaves the others waiting in their all-reduce."""
    from vllm.distributed import get_tp_group  # vLLM exists only inside its own processes: imported when armed

    _log.warning("kvdiag plugin: %s=barrier: this rank calls a barrier no other rank calls (pid %d)", BRANCH_ENV,
                 os.getpid())
    get_tp_group().barrier()


__all__ = ["BRANCH_ENV", "ENABLE_ENV", "HANG_RANK_ENV", "STALL_ENV", "STALL_WHEN_ENV", "STEP_DELAY_ENV", "PoolBacking",
           "build_allocator",
           "rank_local_barrier", "register", "take_null_block"]
