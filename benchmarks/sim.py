"""Benchmark: streamed tokens/s of the simulated engine, and its per-request overhead, on loopback.

Subject: `python -m kvdiag.sim serve` (API server + EngineCore on the stock allocator, a pool large
enough never to fill), 64 concurrent SSE streams of /v1/completions.
Baseline, measured in the same run: a bare starlette app on the same uvicorn that streams the same
SSE events at the same step latency with no engine behind it.
Client: a minimal asyncio HTTP/1.1 client in this process (one keep-alive connection per stream),
counting `data: {` events, so the client costs as little CPU as possible on a 2-core machine.

Prints a table and ends with `RESULT tokens_per_s=... ratio=... overhead_ms=...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvdiag.allocator import remove_device_files  # noqa: E402
from kvdiag.ports import free_port  # noqa: E402
from kvdiag.sim.harness import SimProcess  # noqa: E402

STREAMS = 64
MAX_TOKENS = 128
STEP_MS = 5.0
DURATION_S = 12.0
WARMUP_S = 2.0
SEQUENTIAL_REQUESTS = 150


# --------------------------------------------------------------------------------------------------
# Baseline server: same framing, same pacing, no engine.
def run_baseline_server(port: int, step_ms: float) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    head = '{"id":"cmpl-0000000000000000","object":"text_completion","created":0,"model":"sim-model",'
    pre = f'data: {head}"choices":[{{"index":0,"text":'
    mid = ',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def completions(request: Request) -> Response:
        body = json.loads(await request.body())
        n = int(body.get("max_tokens", 16))
        if not body.get("stream"):
            await asyncio.sleep(step_ms / 1000.0)
            return Response(json.dumps({"choices": [{"text": " the" * n}]}), media_type="application/json")

        async def gen():  # type: ignore[no-untyped-def]
            for _ in range(n):
                await asyncio.sleep(step_ms / 1000.0)
                yield (pre + '" the"' + mid).encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --------------------------------------------------------------------------------------------------
# Client
class Counter:
    def __init__(self) -> None:
        self.events = 0
        self.requests = 0
        self.errors = 0


async def _read_response(reader: asyncio.StreamReader, counter: Counter | None) -> bytes:
    """Read one HTTP/1.1 response (chunked or content-length); count SSE events as they arrive."""
    head = await reader.readuntil(b"\r\n\r\n")
    headers = head.lower()
    body = bytearray()
    if b"transfer-encoding: chunked" in headers:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            chunk = await reader.readexactly(size + 2)
            if counter is not None:
                counter.events += chunk.count(b"data: {")
            body += chunk[:-2]
    else:
        length = 0
        for line in headers.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body += await reader.readexactly(length)
    return bytes(body)


def _request(path: str, payload: dict[str, object]) -> bytes:
    data = json.dumps(payload).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


async def _stream_worker(port: int, counter: Counter, stop: asyncio.Event) -> None:
    req = _request("/v1/completions", {"prompt": "tell me about kv cache pages", "max_tokens": MAX_TOKENS,
                                       "stream": True})
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while not stop.is_set():
            writer.write(req)
            try:
                await _read_response(reader, counter)
                counter.requests += 1
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                counter.errors += 1
                return
    finally:
        writer.close()


async def measure_streams(port: int) -> tuple[float, Counter]:
    counter = Counter()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_stream_worker(port, counter, stop)) for _ in range(STREAMS)]
    await asyncio.sleep(WARMUP_S)
    e0, t0 = counter.events, time.perf_counter()
    await asyncio.sleep(DURATION_S)
    e1, t1 = counter.events, time.perf_counter()
    stop.set()
    await asyncio.wait(tasks, timeout=30)
    for t in tasks:
        t.cancel()
    return (e1 - e0) / (t1 - t0), counter


async def measure_latency(port: int) -> list[float]:
    req = _request("/v1/completions", {"prompt": "hi", "max_tokens": 1})
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out: list[float] = []
    try:
        for _ in range(SEQUENTIAL_REQUESTS):
            t0 = time.perf_counter()
            writer.write(req)
            await _read_response(reader, None)
            out.append(time.perf_counter() - t0)
    finally:
        writer.close()
    return out


def _wait_health(port: int, timeout_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5, trust_env=False).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def _cpu_seconds(pid: int) -> float:
    """utime+stime of ``pid`` and its children (the EngineCore)."""
    total = 0.0
    pids = [pid]
    try:
        from kvdiag.osread.children import children

        pids += children(pid)
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", "rb") as fh:
                rest = fh.read().rsplit(b")", 1)[-1].split()
            total += (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline-server", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_server:
        run_baseline_server(args.baseline_server, STEP_MS)
        return 0

    rows: list[tuple[str, float, float, float, int]] = []
    with tempfile.TemporaryDirectory(prefix="kvdiag-bench-sim-") as tmp:
        # Baseline
        bport = free_port()
        base = subprocess.Popen([sys.executable, __file__, "--baseline-server", str(bport)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            if not _wait_health(bport, 30):
                print("baseline server did not start", file=sys.stderr)
                return 1
            c0 = _cpu_seconds(base.pid)
            b_tps, b_cnt = asyncio.run(measure_streams(bport))
            b_cpu = _cpu_seconds(base.pid) - c0
            b_lat = asyncio.run(measure_latency(bport))
        finally:
            base.terminate()
            try:
                base.wait(timeout=5)
            except subprocess.TimeoutExpired:
                base.kill()
                base.wait(timeout=5)
        rows.append(("baseline (starlette SSE, no engine)", b_tps, statistics.median(b_lat) * 1000, b_cpu,
                     b_cnt.errors))

        # Subject
        device = f"bench{os.getpid()}"
        sim = SimProcess(Path(tmp) / "sim.log", allocator="stock", layers=2, kv_per_layer_mb=4096.0,
                         tokens_per_page=2048, max_running=STREAMS, step_ms=STEP_MS, device_name=device,
                         extra=["--disable-uvicorn-access-log"])
        try:
            sim.start()
            if not sim.wait_healthy(60):
                print("sim did not start:\n" + sim.log_text()[-3000:], file=sys.stderr)
                return 1
            c0 = _cpu_seconds(sim.pid)
            s_tps, s_cnt = asyncio.run(measure_streams(sim.port))
            s_cpu = _cpu_seconds(sim.pid) - c0
            s_lat = asyncio.run(measure_latency(sim.port))
        finally:
            sim.stop()
            remove_device_files(device)
        rows.append(("kvdiag sim (API server + EngineCore)", s_tps, statistics.median(s_lat) * 1000, s_cpu,
                     s_cnt.errors))

    print(f"{STREAMS} concurrent SSE streams x {MAX_TOKENS} tokens, step {STEP_MS:g} ms, {DURATION_S:g} s window; "
          f"{SEQUENTIAL_REQUESTS} sequential max_tokens=1 requests")
    print(f"{'server':40s} {'tokens/s':>10s} {'p50 req ms':>11s} {'server cpu s':>13s} {'errors':>7s}")
    for name, tps, lat, cpu, err in rows:
        print(f"{name:40s} {tps:10.0f} {lat:11.2f} {cpu:13.2f} {err:7d}")
    ratio = s_tps / b_tps if b_tps else 0.0
    overhead = statistics.median(s_lat) * 1000 - statistics.median(b_lat) * 1000
    print(f"ratio sim/baseline = {ratio:.2f}; per-request overhead over baseline = {overhead:.2f} ms "
          f"(both include one {STEP_MS:g} ms step)")
    print(f"RESULT tokens_per_s={s_tps:.0f} baseline_tokens_per_s={b_tps:.0f} ratio={ratio:.2f} "
          f"overhead_ms={overhead:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
