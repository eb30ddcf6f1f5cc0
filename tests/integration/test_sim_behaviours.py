"""The behaviours the simulated engine must reproduce for real (issue: the simulated engine).

1. co-located init deadlock (seed kvcached #371, reproduction A), and its two cures;
2. runtime decode stall under saturated streaming load (reproduction B), and the fixed allocator;
3. healthy-but-slow start;
4. crash (signal, exception) and OOM.

All engines are real `python -m kvdiag.sim serve` process trees on a modelled device of their own;
every wait is bounded and every process group is torn down by its fixture or context manager.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvdiag.allocator import remove_device_files
from kvdiag.osread.ptable import alive as process_alive
from kvdiag.sim.harness import SimProcess

pytestmark = pytest.mark.timeout(150)

BANNER_ENGINE2 = ("Init C++ PageAllocator: num_layers=28, mem_size_per_layer=11MB, total_mem_size=616MB, "
                  "page_size=2MB, world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1, enable_prealloc=1, "
                  "num_kv_buffers=2, group_id=0, min_reserved_pages=5, max_reserved_pages=5")
ENGINE2 = {"layers": 28, "kv_per_layer_mb": 11, "page_size_mb": 2, "min_reserved_pages": 5,
           "max_reserved_pages": 5, "weights_gb": 16, "model": "Qwen/Qwen2-VL-7B-Instruct"}


def _device() -> str:
    return f"kvdb{uuid.uuid4().hex[:10]}"


def _thread_states(pid: int) -> list[tuple[str, str]]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            out.append((state, (task / "wchan").read_text().strip()))
        except OSError:
            continue
    return out


def _cpu_ticks(pid: int) -> int:
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    return int(rest[11]) + int(rest[12])


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def _complete(url: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": max_tokens}, timeout=10,
                      trust_env=False)


# ---------------------------------------------------------------------------------------------------
# 1. Co-located init deadlock
@pytest.fixture(scope="module")
def shared_device() -> Iterator[str]:
    name = _device()
    yield name
    remove_device_files(name)


@pytest.fixture(scope="module")
def engine1(tmp_path_factory: pytest.TempPathFactory, shared_device: str) -> Iterator[SimProcess]:
    """The seed's engine 1 (the coder): 64 layers x 283 MB, stock allocator, prealloc on; serves."""
    log = tmp_path_factory.mktemp("coloc") / "engine1.log"
    sp = SimProcess(log, allocator="stock", layers=64, kv_per_layer_mb=283, page_size_mb=2, weights_gb=33,
                    device_name=shared_device, model="RedHatAI/Qwen2.5-Coder-32B-Instruct-FP8-Dynamic",
                    env={"KVCACHED_IPC_NAME": "CODER", "KVCACHED_PAGE_PREALLOC_ENABLED": "true"})
    with sp:
        assert sp.wait_healthy(30), sp.log_text()[-3000:]
        yield sp


def test_colocated_second_engine_deadlocks_in_the_gil_cycle(engine1: SimProcess, shared_device: str,
                                                             tmp_path: Path) -> None:
    with SimProcess(tmp_path / "engine2.log", allocator="stock", device_name=shared_device,
                    env={"KVCACHED_IPC_NAME": "VLMM", "KVCACHED_PAGE_PREALLOC_ENABLED": "true"}, **ENGINE2) as e2:
        assert e2.wait_log(re.escape(BANNER_ENGINE2), 30), e2.log_text()[-3000:]
        core = e2.engine_core_pid(5)
        assert core is not None
        time.sleep(2.0)
        # Hung right after the banner: never ready, port refuses, nothing more logged by EngineCore.
        log = e2.log_text()
        assert "Application startup complete" not in log
        assert log.rstrip("\n").endswith(BANNER_ENGINE2), "the banner is the last line, as in the seed"
        assert _refused(e2.port)
        assert e2.returncode() is None
        # Every thread parked on a futex, no CPU: a lock wait, not a busy loop.
        states = _thread_states(core)
        assert len(states) >= 2 and all(s == "S" for s, _ in states), states
        assert all("futex" in w for _, w in states), states
        ticks = _cpu_ticks(core)
        time.sleep(1.0)
        assert _cpu_ticks(core) - ticks <= 2
        # The stacks the seed predicts: alloc_page in a condition wait holding the GIL, and the prealloc
        # worker inside map_pages waiting for the GIL (nanobind's tstate_ensure = PyGILState_Ensure).
        pyspy = shutil.which("py-spy")
        if pyspy is not None:
            dump = subprocess.run([pyspy, "dump", "--native", "--pid", str(core)], capture_output=True, text=True,
                                  timeout=30).stdout
            assert "alloc_page" in dump and "pthread_cond_wait" in dump, dump
            assert "prealloc_worker" in dump and "map_pages" in dump, dump
            assert re.search(r"tstate_ensure|PyGILState_Ensure|gil_scoped_acquire|take_gil", dump), dump
        # Engine 1 is unaffected.
        assert engine1.healthy()
        assert _complete(engine1.url).status_code == 200
        # SIGTERM still takes the hung engine down: the API server SIGKILLs the EngineCore that cannot
        # run its Python signal handler (its main thread never returns to the interpreter).
        e2.signal(signal.SIGTERM)
        assert e2.wait_exit(5) == 0
        assert not process_alive(core)
        assert "force killing remaining process EngineCore" in e2.log_text()


@pytest.mark.parametrize("variant", ["prealloc-off", "fixed"])
def test_colocated_second_engine_starts_with_the_cures(engine1: SimProcess, shared_device: str,
                                                       tmp_path: Path, variant: str) -> None:
    env = {"KVCACHED_IPC_NAME": "VLMM",
           "KVCACHED_PAGE_PREALLOC_ENABLED": "false" if variant == "prealloc-off" else "true"}
    allocator = "fixed" if variant == "fixed" else "stock"
    with SimProcess(tmp_path / f"engine2-{variant}.log", allocator=allocator, device_name=shared_device, env=env,
                    **ENGINE2) as e2:
        assert e2.wait_healthy(30), e2.log_text()[-3000:]
        expected = BANNER_ENGINE2 if variant == "fixed" else BANNER_ENGINE2.replace("enable_prealloc=1",
                                                                                     "enable_prealloc=0")
        assert expected in e2.log_text()
        assert _complete(e2.url).status_code == 200
        assert engine1.healthy() and _complete(engine1.url).status_code == 200


# ---------------------------------------------------------------------------------------------------
# 2. Runtime decode stall
async def _stream_forever(url: str, counts: dict[str, int], stop: asyncio.Event, max_tokens: int) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(120)) as client:
        while not stop.is_set():
            try:
                async with client.stream("POST", f"{url}/v1/completions",
                                         json={"prompt": "tell me a story about a kv cache page allocator",
                                               "max_tokens": max_tokens, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            counts["tokens"] += 1
                        elif line == "data: [DONE]":
                            counts["done"] += 1
            except httpx.HTTPError:
                if stop.is_set():
                    return
                counts["errors"] += 1
                await asyncio.sleep(0.1)


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=2, trust_env=False).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total",
                     "vllm:num_preemptions_total"):
            if line.startswith(name + "{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def _run_until_stall(sp: SimProcess, streams: int, window_s: float, quiet_s: float) -> dict[str, object]:
    counts = {"tokens": 0, "done": 0, "errors": 0}
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_stream_forever(sp.url, counts, stop, 256)) for _ in range(streams)]
    t0 = time.monotonic()
    last_tokens, last_change = -1, time.monotonic()
    result: dict[str, object] = {"stalled": False}
    try:
        while time.monotonic() - t0 < window_s:
            await asyncio.sleep(0.5)
            if counts["tokens"] != last_tokens:
                last_tokens, last_change = counts["tokens"], time.monotonic()
            elif counts["tokens"] > 0 and time.monotonic() - last_change >= quiet_s:
                t_metrics = time.monotonic()
                metrics = await asyncio.to_thread(_scrape, sp.url)
                result = {"stalled": True, "after_s": last_change - t0, "metrics": metrics,
                          "metrics_s": time.monotonic() - t_metrics, "healthy": sp.healthy(2.0),
                          "tokens": counts["tokens"]}
                break
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return result


def test_decode_stall_under_saturated_streaming_load(tmp_path: Path) -> None:
    dev = _device()
    try:
        with SimProcess(tmp_path / "stall.log", preset="decode-stall", allocator="stock", device_name=dev) as sp:
            assert sp.wait_healthy(30), sp.log_text()[-3000:]
            res = asyncio.run(_run_until_stall(sp, streams=32, window_s=25, quiet_s=3))
            assert res["stalled"], f"no stall within 25 s: {sp.log_text()[-2000:]}"
            metrics = res["metrics"]
            assert isinstance(metrics, dict)
            # /metrics still answers, fast, with KV near full and requests running: no tokens come out.
            assert res["healthy"] is True
            assert isinstance(res["metrics_s"], float) and res["metrics_s"] < 5.0  # answers, not wedged
            assert metrics["vllm:num_requests_running"] > 0
            assert metrics["vllm:kv_cache_usage_perc"] > 0.8
            m2 = _scrape(sp.url)
            assert m2["vllm:generation_tokens_total"] == metrics["vllm:generation_tokens_total"]
            core = sp.engine_core_pid(2)
            assert core is not None
            # Wedged: every thread sleeps. The scrape just above briefly wakes the metrics thread,
            # so look until it is back asleep (bounded).
            deadline = time.monotonic() + 5.0
            while not all(s == "S" for s, _ in _thread_states(core)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert all(s == "S" for s, _ in _thread_states(core)), _thread_states(core)
    finally:
        remove_device_files(dev)


async def _run_batch(url: str, streams: int, max_tokens: int) -> list[int]:
    async def one(client: httpx.AsyncClient) -> int:
        n = 0
        async with client.stream("POST", f"{url}/v1/completions",
                                 json={"prompt": "tell me a story about a kv cache page allocator",
                                       "max_tokens": max_tokens, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n += 1
                elif line == "data: [DONE]":
                    return n
        return -1

    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(60),
                                 limits=httpx.Limits(max_connections=streams + 2)) as client:
        return list(await asyncio.wait_for(asyncio.gather(*(one(client) for _ in range(streams))), 60))


def test_fixed_allocator_completes_the_same_load(tmp_path: Path) -> None:
    dev = _device()
    try:
        with SimProcess(tmp_path / "fixed.log", preset="decode-stall", allocator="fixed", device_name=dev) as sp:
            assert sp.wait_healthy(30), sp.log_text()[-3000:]
            for _ in range(2):  # two waves: the pool fills, drains and fills again
                assert asyncio.run(_run_batch(sp.url, 32, 256)) == [256] * 32
            m = _scrape(sp.url)
            assert m["vllm:num_requests_running"] == 0
    finally:
        remove_device_files(dev)


# ---------------------------------------------------------------------------------------------------
# 3. Healthy-but-slow start
def test_slow_start_keeps_logging_progress(tmp_path: Path) -> None:
    dev = _device()
    try:
        with SimProcess(tmp_path / "slow.log", allocator="fixed", device_name=dev,
                        extra=["--slow-phase", "load", "--slow-s", "3", "--progress-every-s", "0.5"]) as sp:
            assert sp.wait_log(r"Loading safetensors checkpoint shards: .*1/6", 15)
            core = sp.engine_core_pid(2)
            assert core is not None
            ticks = _cpu_ticks(core)
            time.sleep(1.0)
            assert not sp.healthy(), "ready before the slow phase ended"
            assert _cpu_ticks(core) - ticks > 2, "the slow phase shows CPU activity"
            assert sp.wait_healthy(30)
            log = sp.log_text()
            progress = [m.start() for m in re.finditer(r"Loading safetensors checkpoint shards: +\d+% Completed", log)]
            assert len(progress) == 6
            assert progress[-1] < log.index("Application startup complete.")
    finally:
        remove_device_files(dev)


# ---------------------------------------------------------------------------------------------------
# 4. Crash and OOM
def test_exception_at_startup_fails_like_vllm(tmp_path: Path) -> None:
    dev = _device()
    try:
        with SimProcess(tmp_path / "raise.log", allocator="fixed", device_name=dev,
                        extra={"fail-mode": "raise", "fail-at": "profile"}) as sp:
            assert sp.wait_exit(30) == 1
            log = sp.log_text()
            assert re.search(r"^\(EngineCore pid=\d+\) ERROR .* EngineCore failed to start\.$", log, re.M)
            assert "SimulatedEngineError" in log and "Traceback (most recent call last)" in log
            assert "Engine core initialization failed. See root cause above. Failed core proc(s): " \
                   "{'EngineCore': 1}" in log
            assert "Application startup complete" not in log
    finally:
        remove_device_files(dev)


@pytest.mark.parametrize("mode", ["signal", "raise"])
def test_engine_core_dies_while_serving(tmp_path: Path, mode: str) -> None:
    dev = _device()
    try:
        with SimProcess(tmp_path / "die.log", allocator="fixed", device_name=dev,
                        extra={"fail-mode": mode, "fail-signal": "SIGKILL", "fail-at": "serving",
                               "fail-after-tokens": 20, "engine-dead-exit-s": 1.0}) as sp:
            assert sp.wait_healthy(30), sp.log_text()[-2000:]
            core = sp.engine_core_pid(2)
            assert core is not None
            r = httpx.post(f"{sp.url}/v1/completions", json={"prompt": "x", "max_tokens": 500, "stream": True},
                           timeout=30, trust_env=False)
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][len("data: "):])["error"]["code"] == 500
            assert not process_alive(core)
            status = httpx.get(f"{sp.url}/health", timeout=2, trust_env=False).status_code
            assert status == 503
            assert sp.wait_exit(15) == 1
            log = sp.log_text()
            assert "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup" in log
            assert "EngineDeadError: EngineCore encountered an issue." in log
            if mode == "raise":
                assert re.search(r"^\(EngineCore pid=\d+\) ERROR .* EngineCore encountered a fatal error\.$", log,
                                 re.M)
                assert "SimulatedEngineError: simulated engine failure" in log
    finally:
        remove_device_files(dev)


def test_oom_when_mapping_the_first_kv_page(tmp_path: Path) -> None:
    dev = _device()
    try:
        with SimProcess(tmp_path / "oom.log", allocator="fixed", device_name=dev,
                        extra={"fail-mode": "oom", "fail-at": "kv_init"}) as sp:
            assert sp.wait_exit(30) == 1
            log = sp.log_text()
            banner = log.index("Init C++ PageAllocator:")
            oom = re.search(r"OutOfMemoryError: CUDA out of memory while mapping KV cache pages: .*out of memory", log)
            assert oom is not None and oom.start() > banner
            assert "Engine core initialization failed" in log
    finally:
        remove_device_files(dev)


def test_orphaned_device_usage_is_released(tmp_path: Path) -> None:
    """A killed engine's weights and pages stop counting on the shared device (no phantom OOM later)."""
    from kvdiag.allocator import native_module

    native = native_module()
    dev = _device()
    try:
        with SimProcess(tmp_path / "usage.log", allocator="fixed", device_name=dev, weights_gb=10) as sp:
            assert sp.wait_healthy(30)
            assert native.device_used_bytes(dev) >= 10 * 1024**3
            core = sp.engine_core_pid(2)
            assert core is not None
            os.kill(core, 9)
            deadline = time.monotonic() + 10
            while native.device_used_bytes(dev) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert native.device_used_bytes(dev) == 0
    finally:
        remove_device_files(dev)
