"""The simulated EngineCore process: startup phases, the KV pool on kvdiag's page allocator, the busy loop.

It runs as a multiprocessing *spawn* child of the API server, titled ``VLLM::EngineCore`` like
vLLM's. At TP=1 vLLM's model runner lives in this process too, so the KV cache and its page
allocator are here, and the null-block ``alloc_page`` of kvcached's ElasticBlockPool runs on this
process's main thread, right after the allocator prints its ``Init C++ PageAllocator`` banner.

Threads: the main thread runs startup and the busy loop (schedule -> forward -> outputs);
``process_input_sockets`` reads the pipe from the API server; ``process_output_sockets`` writes
to it. All three need the GIL, so when the main thread parks in ``alloc_page`` holding the GIL
(the stock allocator's cycle), the whole process goes quiet, as the real one does.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any, cast

from kvdiag.allocator import make_allocator, native_module
from kvdiag.sim import protocol as P
from kvdiag.sim import vlog
from kvdiag.sim.config import GB, SimConfig
from kvdiag.sim.scheduler import OutOfMemoryError, PageAllocator, Scheduler, alloc_or_oom

VLLM_VERSION = "0.32.0"
PROCESS_TITLE = "VLLM::EngineCore"
_PR_SET_PDEATHSIG = 1
_STATS_PERIOD_S = 0.05
_IDLE_POLL_S = 0.1


class EngineShutdown(BaseException):
    """SIGTERM/SIGINT reached EngineCore (BaseException so no `except Exception` swallows it)."""


class SimulatedEngineError(RuntimeError):
    """Raised on purpose by ``--fail-mode raise``."""


def _set_parent_death_signal(parent_pid: int) -> None:
    """Die with the API server even if it is SIGKILLed (real vLLM orphans EngineCore here)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _set_title() -> None:
    try:
        import setproctitle  # optional in a subject's interpreter: prctl(PR_SET_NAME) below is the fallback

        setproctitle.setproctitle(PROCESS_TITLE)
    except ImportError:  # comm still changes through prctl(PR_SET_NAME)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(15, ctypes.c_char_p(PROCESS_TITLE.encode()[:15]), 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _signal_by_name(name: str) -> int:
    name = name.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    return int(getattr(signal, name, signal.SIGKILL))


class EngineCore:
    """One simulated engine: startup, KV pool, scheduler and the busy loop."""

    def __init__(self, cfg: SimConfig, conn: Connection) -> None:
        self.cfg = cfg
        self.conn = conn
        self.log = vlog.get_logger()
        self.allocator: PageAllocator | None = None
        self.native_allocator: Any = None
        self.sched: Scheduler | None = None
        self.null_page: int | None = None
        self.phase = "load"
        self.ready_t: float | None = None
        self.oom_armed = False
        self.weights_bytes = 0
        self.worker_mapped_bytes = 0
        self.inq: queue.Queue[P.Message | None] = queue.Queue()
        self.outq: queue.Queue[P.Message | None] = queue.Queue()
        self._last_stats_t = 0.0
        self._idle_stats_sent = False
        self._output_thread: threading.Thread | None = None

    # -- failure injection ----------------------------------------------------------------------------
    def _maybe_fail(self, phase: str) -> None:
        cfg = self.cfg
        if cfg.fail_mode == "none" or cfg.fail_at != phase:
            return
        if phase != "serving" and cfg.fail_after_s > 0:
            time.sleep(cfg.fail_after_s)
        self._fail(phase)

    def _fail(self, phase: str) -> None:
        cfg = self.cfg
        if cfg.fail_mode == "signal":
            sig = _signal_by_name(cfg.fail_signal)
            vlog.flush()
            os.kill(os.getpid(), sig)
            time.sleep(5)  # a caught or ignored signal: fall through to a hard exit
            os._exit(128 + sig)
        if cfg.fail_mode == "raise":
            raise SimulatedEngineError(f"simulated engine failure (kvdiag sim --fail-mode raise) in phase {phase}")
        if cfg.fail_mode == "oom":
            if phase in ("kv_init", "serving"):
                # Something else takes the rest of the device: the next KV page map fails for real.
                self.oom_armed = True
                self._fill_device()
                return
            free_gb = max(0.0, cfg.device_size_gb - cfg.weights_gb)
            raise OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {max(cfg.weights_gb, 1.0):.2f} GiB. GPU 0 has a total "
                f"capacity of {cfg.device_size_gb:.2f} GiB of which {free_gb * 0.01:.2f} GiB is free. "
                "(simulated by kvdiag sim --fail-mode oom)")

    # -- the "worker" side of kvcached's map/unmap broadcast ------------------------------------------
    def _page_bytes(self) -> int:
        cfg = self.cfg
        return cfg.page_size * cfg.layers * cfg.num_kv_buffers

    def _worker_map(self, world_size: int, offsets: Sequence[int]) -> None:
        """kvcached's broadcast_map_to_kv_tensors (``--worker-ipc true``): the model runner maps the pages.

        Runs on whichever thread maps (the prealloc worker included) and, being Python, needs the
        GIL. The pages' bytes are charged to this process on the modelled device.
        """
        need = len(offsets) * self._page_bytes()
        if self.cfg.backend == "host":
            _native = native_module()
            if _native.device_used_bytes(self.cfg.device_name) + need > self.cfg.device_size:
                raise OutOfMemoryError(f"CUDA out of memory: device {self.cfg.device_name} has no room for "
                                       f"{need} bytes of KV pages")
            self.worker_mapped_bytes += need
            _native.register_device_usage(self.cfg.device_name, self._device_usage())

    def _worker_unmap(self, world_size: int, offsets: Sequence[int]) -> None:
        self.worker_mapped_bytes = max(0, self.worker_mapped_bytes - len(offsets) * self._page_bytes())
        if self.cfg.backend == "host":
            _native = native_module()
            _native.register_device_usage(self.cfg.device_name, self._device_usage())

    def _device_usage(self) -> int:
        return self.weights_bytes + self.worker_mapped_bytes

    def _fill_device(self) -> None:
        """``--fail-mode oom``: the modelled device fills up, so the next page map finds no room."""
        self.weights_bytes = self.cfg.device_size
        if self.cfg.backend == "host":
            _native = native_module()
            _native.register_device_usage(self.cfg.device_name, self._device_usage())

    # -- startup --------------------------------------------------------------------------------------
    def _progress_phase(self, label: str, total_s: float, unit: str) -> None:
        """A slow phase that keeps logging progress (tqdm-style lines on stderr, as vLLM's loaders print)."""
        cfg = self.cfg
        steps = max(1, int(total_s / max(cfg.progress_every_s, 0.05)))
        per = total_s / steps
        t0 = time.monotonic()
        for i in range(1, steps + 1):
            end = t0 + per * i
            # Real loading uses CPU; a light duty cycle keeps the phase visibly alive on /proc too.
            spin_until = min(end, time.monotonic() + per * 0.2)
            while time.monotonic() < spin_until:
                pass
            delay = end - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            el = time.monotonic() - t0
            left = max(0.0, total_s - el)
            pct = int(100 * i / steps)
            print(f"{label}: {pct:3d}% Completed | {i}/{steps} [{_mmss(el)}<{_mmss(left)}, {per:.2f}s/{unit}]",
                  file=sys.stderr, flush=True)

    def _phase_sleep(self, phase: str, seconds: float) -> None:
        if self.cfg.slow_phase == phase and self.cfg.slow_s > 0:
            label = {"load": "Loading safetensors checkpoint shards",
                     "profile": "Profiling memory usage (simulated)",
                     "warmup": "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE)"}[phase]
            self._progress_phase(label, self.cfg.slow_s, "it")
        elif seconds > 0:
            time.sleep(seconds)

    def startup(self) -> dict[str, Any]:
        cfg = self.cfg
        log = self.log
        t_init = time.monotonic()
        log.info("kvdiag simulated engine (not vLLM): EngineCore with allocator=%s backend=%s device=%s, "
                 "prealloc=%s", cfg.allocator, cfg.backend, cfg.device_name, int(cfg.prealloc))
        log.info("Initializing a V1 LLM engine (v%s) with config: model=%r, speculative_config=None, "
                 "tokenizer=%r, skip_tokenizer_init=False, tokenizer_mode=auto, revision=None, dtype=torch.bfloat16, "
                 "max_seq_len=%d, download_dir=None, load_format=auto, tensor_parallel_size=1, "
                 "pipeline_parallel_size=1, data_parallel_size=1, quantization=None, enforce_eager=False, "
                 "kv_cache_dtype=auto, device_config=cuda, seed=%d, served_model_name=%s, "
                 "enable_prefix_caching=False, enable_chunked_prefill=True",
                 VLLM_VERSION, cfg.model, cfg.model, cfg.max_model_len, cfg.seed, cfg.name)

        # Model load: the weights take their share of the (modelled) device.
        self.phase = "load"
        log.info("Starting to load model %s...", cfg.model)
        t0 = time.monotonic()
        self._maybe_fail("load")
        self._phase_sleep("load", cfg.load_s)
        self.weights_bytes = cfg.weights_bytes
        if cfg.backend == "host" and cfg.weights_bytes > 0:
            _native = native_module()
            _native.register_device_usage(cfg.device_name, self._device_usage())
        took = time.monotonic() - t0
        log.info("Loading weights took %.2f seconds", took)
        log.info("Model loading took %.4f GiB memory and %.6f seconds", cfg.weights_gb, took)

        # Memory profiling.
        self.phase = "profile"
        t0 = time.monotonic()
        self._maybe_fail("profile")
        self._phase_sleep("profile", cfg.profile_s)
        kv_bytes = cfg.num_kv_buffers * cfg.layers * cfg.mem_size_per_layer
        log.info("Memory profiling takes %.2f seconds", time.monotonic() - t0)
        log.info("Available KV cache memory: %.2f GiB", kv_bytes / GB)

        # KV cache sizing, then warm-up (graph capture) before the engine reports its init time.
        self.phase = "warmup"
        total_tokens = cfg.pages_per_layer * cfg.tokens_per_page
        log.info("GPU KV cache size: %s tokens", f"{total_tokens:,}")
        log.info("Maximum concurrency for %s tokens per request: %.2fx", f"{cfg.max_model_len:,}",
                 total_tokens / max(1, cfg.max_model_len))
        t0 = time.monotonic()
        self._maybe_fail("warmup")
        self._phase_sleep("warmup", cfg.warmup_s)
        log.info("Graph capturing finished in %.0f secs, took 0.00 GiB", time.monotonic() - t0)
        log.info("init engine (profile, create kv cache, warmup model) took %.2f seconds",
                 time.monotonic() - t_init)

        # Scheduler construction: kvcached's ElasticBlockPool builds the page allocator (banner) and
        # takes the null block with alloc_page on this, the EngineCore main thread.
        self.phase = "kv_init"
        if cfg.kv_init_s > 0:
            time.sleep(cfg.kv_init_s)
        if cfg.fail_mode == "oom":
            self._maybe_fail("kv_init")  # before the pool exists, so its very first map fails
        self._init_kv_pool()
        if cfg.fail_mode != "oom":
            self._maybe_fail("kv_init")
        self._take_null_block()

        self.phase = "serving"
        alloc = cast(PageAllocator, self.allocator)
        self.sched = Scheduler(alloc, cfg.max_running, cfg.tokens_per_page, cfg.seed)
        self.ready_t = time.monotonic()
        return {
            "num_gpu_blocks": alloc.get_num_total_pages() * max(1, cfg.tokens_per_page // cfg.block_size),
            "kv_cache_size_tokens": alloc.get_num_total_pages() * cfg.tokens_per_page,
            "total_pages": alloc.get_num_total_pages(),
            "block_size": cfg.block_size,
            "allocator": cfg.allocator,
            "prealloc": int(cfg.prealloc),
            "startup_s": round(time.monotonic() - t_init, 3),
        }

    def _init_kv_pool(self) -> None:
        cfg = self.cfg
        # Logged before the allocator exists: as in the seed, the banner is the last line of a hung engine.
        self.log.info("kvdiag sim: building the KV pool: %d pages of %d MiB x %d layers, %d tokens/page, on %s/%s",
                      cfg.pages_per_layer, cfg.page_size_mb, cfg.layers, cfg.tokens_per_page, cfg.backend,
                      cfg.device_name)
        vlog.flush()  # the banner comes from C++ on the same stdout: keep the order
        native = make_allocator(
            cfg.allocator, num_layers=cfg.layers, mem_size_per_layer=cfg.mem_size_per_layer,
            page_size=cfg.page_size, world_size=1, pp_rank=0, async_sched=cfg.async_scheduling,
            contiguous_layout=cfg.contiguous_layout, enable_prealloc=cfg.prealloc,
            num_kv_buffers=cfg.num_kv_buffers, group_id=0, min_reserved_pages=cfg.min_reserved_pages,
            max_reserved_pages=cfg.max_reserved_pages, gpu_utilization=cfg.kvcached_gpu_utilization,
            backend=cfg.backend, device_name=cfg.device_name, device_size=cfg.device_size,
            map_latency_us=cfg.map_latency_us, ipc_name=cfg.ipc_name,
            allow_partial_page=True,  # kvcached floors mem_size_per_layer / page_size (the seed's 11 MB / 2 MB)
        )
        sys.stdout.flush()
        self.native_allocator = native
        self.allocator = cast(PageAllocator, native)
        # What kvcached's KVCacheManager does in vLLM's EngineCore: it always registers the Python
        # should_use_worker_ipc callback (the stock allocator calls it from every thread that maps,
        # the prealloc worker included); at TP=1 the model runner shares the process, so the answer
        # is false and pages map natively. The fixed allocator takes the answer once instead
        # (kvcached's post-fix set_use_worker_ipc). With worker IPC the map goes through the Python
        # broadcast callbacks.
        ipc = cfg.worker_ipc
        if cfg.allocator != "fixed" and hasattr(native, "set_should_use_worker_ipc_callback"):
            native.set_should_use_worker_ipc_callback(_always_true if ipc else _always_false)
        else:
            native.set_use_worker_ipc(ipc)
        if ipc:
            native.set_broadcast_map_callback(self._worker_map)
            native.set_broadcast_unmap_callback(self._worker_unmap)
            self.log.info("Set up broadcast callbacks for multi-process (world_size=1, use_worker_ipc=True)")
        native.start_prealloc_thread()

    def _take_null_block(self) -> None:
        """The null block: kvcached's ``alloc(1)`` right after the pool is built.

        Models the ordering the real engine's CUDA init work produces: by the time the null-block
        request reaches alloc_page, the prealloc worker (started a moment earlier) has taken its
        first batch off the free list and is mapping it. So wait, bounded and holding the GIL the way
        Python code running between the two calls does, until the worker has pages in flight (or has
        already reserved some), then allocate. The switch interval is raised for that moment so an
        unlucky OS preemption of this thread cannot hand the GIL to the worker first.
        """
        alloc = cast(PageAllocator, self.allocator)
        old_interval = sys.getswitchinterval()
        if self.cfg.prealloc and self.cfg.warmup_wait_ms > 0:
            sys.setswitchinterval(0.1)
            deadline = time.perf_counter() + self.cfg.warmup_wait_ms / 1000.0
            while time.perf_counter() < deadline:
                if alloc.get_num_inflight_pages() > 0 or alloc.get_num_reserved_pages() > 0:
                    break
        try:
            self.null_page = alloc_or_oom(alloc)
        finally:
            sys.setswitchinterval(old_interval)

    # -- serving --------------------------------------------------------------------------------------
    def _input_loop(self) -> None:
        conn = self.conn
        inq = self.inq
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                inq.put(None)
                return
            inq.put(msg)

    def _output_loop(self) -> None:
        P.pump(self.outq, self.conn)

    def _handle(self, msg: P.Message, now: float) -> list[P.FinishedTuple]:
        sched = cast(Scheduler, self.sched)
        kind = msg[0]
        if kind == P.ADD:
            sched.add(msg[1], msg[2], msg[3], msg[4])
        elif kind == P.ABORT:
            fin = sched.abort(msg[1], now)
            if fin is not None:
                return [fin]
        return []

    def _stats_due(self, now: float) -> bool:
        if now - self._last_stats_t >= _STATS_PERIOD_S:
            self._last_stats_t = now
            return True
        return False

    def _serving_fail_due(self, now: float) -> bool:
        cfg = self.cfg
        if cfg.fail_mode == "none" or cfg.fail_at != "serving" or self.oom_armed:
            return False
        sched = cast(Scheduler, self.sched)
        return (now - (self.ready_t or now) >= cfg.fail_after_s
                and sched.generation_tokens >= cfg.fail_after_tokens)

    def busy_loop(self) -> None:
        sched = cast(Scheduler, self.sched)
        inq = self.inq
        outq = self.outq
        step_s = self.cfg.step_ms / 1000.0
        while True:
            now = time.monotonic()
            if self._serving_fail_due(now):
                self._fail("serving")
            aborted: list[P.FinishedTuple] = []
            if not sched.has_work():
                if not self._idle_stats_sent:
                    outq.put((P.STATS, now, sched.stats()))
                    self._idle_stats_sent = True
                try:
                    msg = inq.get(timeout=_IDLE_POLL_S)
                except queue.Empty:
                    continue
                if msg is None:
                    return
                aborted += self._handle(msg, time.monotonic())
            while True:
                try:
                    msg = inq.get_nowait()
                except queue.Empty:
                    break
                if msg is None:
                    return
                aborted += self._handle(msg, time.monotonic())
            if not sched.has_work():
                if aborted:
                    outq.put((P.OUTPUT, time.monotonic(), [], aborted, sched.stats()))
                continue
            self._idle_stats_sent = False
            t0 = time.monotonic()
            sched.schedule(t0)
            # The forward pass (GPU work in a real engine; the GIL is free meanwhile).
            delay = step_s - (time.monotonic() - t0)
            if delay > 0:
                time.sleep(delay)
            t = time.monotonic()
            tokens, finished = sched.update(t)
            if aborted:
                finished = aborted + finished
            stats = sched.stats() if (self._stats_due(t) or not sched.has_work()) else None
            outq.put((P.OUTPUT, t, tokens, finished, stats))

    def serve(self) -> None:
        threading.Thread(target=self._input_loop, name="process_input_sockets", daemon=True).start()
        self._output_thread = threading.Thread(target=self._output_loop, name="process_output_sockets",
                                               daemon=True)
        self._output_thread.start()
        self.busy_loop()

    def report_error(self, text: str) -> None:
        """Tell the API server why we die; through the output thread once it owns the pipe."""
        msg = (P.ERROR, text)
        thread = self._output_thread
        try:
            if thread is None:
                self.conn.send(msg)
                return
            self.outq.put(msg)
            self.outq.put(None)
            thread.join(timeout=1.0)
        except (OSError, ValueError):
            pass


def _always_true() -> bool:
    return True


def _always_false() -> bool:
    return False


def _mmss(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60:02d}:{s % 60:02d}"


def _install_signal_handlers(log_fn: Callable[[str], None]) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        log_fn(f"[shutdown] EngineCore: trigger received signal={signal.Signals(signum).name}")
        raise EngineShutdown()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def run_engine_core(cfg: SimConfig, conn: Connection, parent_pid: int) -> None:
    """Entry point of the EngineCore spawn child (never returns)."""
    _set_parent_death_signal(parent_pid)
    _set_title()  # before any thread starts, so every thread's comm is VLLM::EngineCor
    log = vlog.setup("EngineCore")
    _install_signal_handlers(log.info)
    core = EngineCore(cfg, conn)
    started = False
    code = 0
    try:
        info = core.startup()
        conn.send((P.READY, info))
        started = True
        core.serve()
        log.info("kvdiag sim: the API server closed the engine pipe; EngineCore exits")
    except EngineShutdown:
        log.info("[shutdown] EngineCore: start mode=abort timeout=0s")
        log.info("[shutdown] EngineCore: request processing complete; starting resource teardown")
        log.info("[shutdown] EngineCore: exiting busy loop")
    except Exception as exc:
        if started:
            log.exception("EngineCore encountered a fatal error.")
        else:
            log.exception("EngineCore failed to start.")
        core.report_error("".join(traceback.format_exception_only(type(exc), exc)).strip())
        code = 1
    vlog.flush()
    # No interpreter teardown: the stock allocator's destructor joins its worker with the GIL held,
    # which is kvcached's other deadlock; the API server would SIGKILL us anyway.
    os._exit(code)

