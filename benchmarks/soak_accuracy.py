"""Benchmark: how accurate, and how cheap, kvdiag's soak load generator's TTFT/ITL figures are.

Server: one simulated engine (`python -m kvdiag.sim serve`, fixed allocator, a KV pool that never
fills, --step-ms 20), so tokens come at a steady pace and nothing stalls.

Reference for accuracy (measures the SAME stream): a tap under kvdiag's HTTP stack. kvdiag's
LoadGenerator runs on an httpx transport whose httpcore network backend records, for every socket
write and read, the time and the bytes. Code written here (nothing shared with kvdiag: a hand
decoder of the HTTP/1.1 chunked body and a split on blank lines) turns those raw reads into TTFT
(request bytes written -> read that completed the first token event) and ITL (between the reads
that completed consecutive token events) for exactly the requests and tokens kvdiag measured.
The difference is kvdiag's own error: its request-issue overhead, httpx/httpcore/h11 decoding,
its SSE parser and JSON handling. (What both share, event-loop lag before the socket read, is
not in it: the second reference below covers that.)
Errors are relative: |kvdiag - reference| / reference, for TTFT and ITL p50 and p99.

Second reference, and the CPU baseline: an independent minimal client on raw asyncio sockets
(same request, same warm-up, same concurrency) running at the same time as kvdiag's client
against the same server, in its own process. Its percentiles are printed for comparison (other
requests of the same server, so they differ by sampling); the server's own bucketed histograms
are printed too.
cpu_ratio = (kvdiag client CPU seconds / tokens it received) / (raw-socket client CPU seconds /
tokens it received), measured in a second phase with the tap off, both clients running at once:
CPU (user+sys, time.process_time of each client process over its load window) per received token.

Prints tables and ends with
`RESULT ttft_p50_err=... itl_p50_err=... ttft_p99_err=... itl_p99_err=... cpu_ratio=...`.

``--vllm``: kvdiag's soak client and `vllm bench serve` on the SAME real vLLM CPU server (prefix
caching off), ONE CLIENT AT A TIME, in cycles of three runs, bench / kvdiag / bench2, the order rotated each
cycle (bench2 is bench again: the reference measured against itself the same way gives the noise floor).
Every run sends the same request mix: 48 completions, 64 prompt tokens (bench: its random dataset, seed 0 in
every run; kvdiag: 64 random token ids, seed 0), 32 output tokens with ignore_eos, 4 at a time.
The model is scripts/make_tiny_llama.py at a larger size (8 layers, hidden 768, 48M parameters; cached under
~/.cache/kvdiag/tiny-llama-8x768), so one decode step costs the server ~10 ms against ~1-2 ms of API-server
work per step for 4 streams. With CI's 2-layer model (and 8 streams) a step took well under the time the API
server and the clients need to write and read it: several SSE events came in one socket read, ITL p50
flipped between ~0 and one step from run to run, and measured client and API-server lag, not the server.
Both clients' raw samples (bench's via --save-detailed) are reduced here by one function, numpy's linear
percentile (bench's own summary figures are reproduced from its samples as a check):
- TTFT: from the moment the client begins the request (bench: `st` before aiohttp builds and writes it;
  kvdiag: just before its pre-built request is written) to the first SSE event carrying a choice.
- ITL: gaps between consecutive such events of one request, per event (not split per token), pooled.
Per metric: the median over cycles of each run's figure; diff = |kvdiag - bench| / bench; noise floor =
|bench2 - bench| / bench. The server's own TTFT/ITL means over each run (its /metrics histograms' sum and
count, before and after the run) give each client's error free of the server's run-to-run drift.
Also: client CPU per request (user+sys of the client process over its load window;
bench's read from /proc between its "Starting main benchmark run" line and its result banner), output tokens
(usage), failures (kvdiag's SSE parse failures beside bench's failed requests), the share of ITL gaps under
0.5 ms (events taken from one read), load average. Needs scripts/setup_vllm_cpu.sh. Ends with
`RESULT ttft_p50_err=... itl_p50_err=... ttft_p99_err=... itl_p99_err=... cpu_ratio=... noise_...=...
parse_failures=... bench_failed=...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Tell me a story about a page allocator."
KEYS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    rank = q / 100.0 * (len(s) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def _body(max_tokens: int) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


def _wait_until(t_wall: float) -> None:
    delay = t_wall - time.time()
    if delay > 0:
        time.sleep(delay)


def _token_events(buf: bytes) -> tuple[int, bytes]:
    """Count completed token events in ``buf``; returns (count, rest)."""
    n = 0
    while b"\n\n" in buf:
        ev, buf = buf.split(b"\n\n", 1)
        if ev.startswith(b"data: {") and b'"choices":[]' not in ev:
            n += 1
    return n, buf


# --------------------------------------------------------------------------------------------------
# the socket tap (same-stream reference)
class ConnTap:
    """Decodes one connection's responses from raw reads; only POST requests are measured."""

    def __init__(self, sink: dict[str, list[float]]) -> None:
        self.sink = sink
        self.t0: float | None = None      # write time of the current POST
        self.measured = False
        self.raw = b""                    # undecoded bytes
        self.in_body = False
        self.chunked = False
        self.left = 0                     # content-length bytes still to skip
        self.events = b""
        self.last: float | None = None

    def on_write(self, data: bytes, t: float) -> None:
        if data[:5] == b"POST ":
            self.t0, self.measured, self.last = t, True, None
        elif data[:4] == b"GET ":
            self.measured = False

    def on_read(self, data: bytes, t: float) -> None:
        self.raw += data
        while True:
            if not self.in_body:
                end = self.raw.find(b"\r\n\r\n")
                if end < 0:
                    return
                head, self.raw = self.raw[:end].lower(), self.raw[end + 4:]
                self.chunked = b"transfer-encoding: chunked" in head
                m = re.search(rb"content-length: *(\d+)", head)
                self.left = int(m.group(1)) if m and not self.chunked else 0
                self.in_body, self.events = True, b""
                continue
            if not self.chunked:
                take = min(self.left, len(self.raw))
                self.raw, self.left = self.raw[take:], self.left - take
                if self.left == 0:
                    self.in_body = False
                    continue
                return
            line_end = self.raw.find(b"\r\n")
            if line_end < 0:
                return
            size = int(self.raw[:line_end].split(b";")[0], 16)
            if size == 0:
                if len(self.raw) < line_end + 4:
                    return
                self.raw, self.in_body = self.raw[line_end + 4:], False
                continue
            if len(self.raw) < line_end + 2 + size + 2:
                return
            self.events += self.raw[line_end + 2:line_end + 2 + size]
            self.raw = self.raw[line_end + 2 + size + 2:]
            n, self.events = _token_events(self.events)
            if self.measured and self.t0 is not None:
                for _ in range(n):
                    if self.last is None:
                        self.sink["ttft"].append(t - self.t0)
                    else:
                        self.sink["itl"].append(t - self.last)
                    self.last = t
                    self.sink["tokens"].append(t)


def _tap_transport(concurrency: int, sink: dict[str, list[float]]) -> Any:
    import httpcore
    import httpx

    class TapStream(httpcore.AsyncNetworkStream):
        def __init__(self, inner: httpcore.AsyncNetworkStream, tap: ConnTap) -> None:
            self.inner, self.tap = inner, tap

        async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            data = await self.inner.read(max_bytes, timeout)
            self.tap.on_read(data, time.monotonic())
            return data

        async def write(self, buffer: bytes, timeout: float | None = None) -> None:
            self.tap.on_write(buffer, time.monotonic())
            await self.inner.write(buffer, timeout)

        async def aclose(self) -> None:
            await self.inner.aclose()

        def get_extra_info(self, info: str) -> Any:
            return self.inner.get_extra_info(info)

    class TapBackend(httpcore.AsyncNetworkBackend):
        def __init__(self) -> None:
            self.inner = httpcore.AnyIOBackend()

        async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                              local_address: str | None = None, socket_options: Any = None) -> Any:
            s = await self.inner.connect_tcp(host, port, timeout=timeout, local_address=local_address,
                                             socket_options=socket_options)
            return TapStream(s, ConnTap(sink))

        async def sleep(self, seconds: float) -> None:
            await self.inner.sleep(seconds)

    transport = httpx.AsyncHTTPTransport()
    transport._pool = httpcore.AsyncConnectionPool(  # the benchmark's hook; kvdiag itself never does this
        max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2, network_backend=TapBackend())
    return transport


# --------------------------------------------------------------------------------------------------
# client processes
def client_kvdiag(url: str, concurrency: int, duration: float, max_tokens: int, start_at: float,
                  tap: bool) -> dict[str, Any]:
    from kvdiag.load.loadgen import LoadGenerator
    from kvdiag.load.request import LoadConfig

    cfg = LoadConfig(base_url=url, concurrency=concurrency, max_tokens=max_tokens, prompt=PROMPT)
    sink: dict[str, list[float]] = {"ttft": [], "itl": [], "tokens": []}
    _wait_until(start_at)
    cpu0 = time.process_time()
    lg = LoadGenerator(cfg, transport=_tap_transport(concurrency, sink) if tap else None)
    summary = asyncio.run(lg.run_for(duration))
    cpu = time.process_time() - cpu0
    out: dict[str, Any] = {"ttft_p50": summary.ttft.p50_s, "ttft_p99": summary.ttft.p99_s,
                           "itl_p50": summary.itl.p50_s, "itl_p99": summary.itl.p99_s, "tokens": summary.tokens,
                           "ttft_n": summary.ttft.count, "itl_n": summary.itl.count, "cpu_s": cpu,
                           "errors": summary.requests_failed + summary.requests_timed_out}
    if tap:
        out["tap"] = {"ttft_p50": _pct(sink["ttft"], 50), "ttft_p99": _pct(sink["ttft"], 99),
                      "itl_p50": _pct(sink["itl"], 50), "itl_p99": _pct(sink["itl"], 99),
                      "tokens": len(sink["tokens"]), "ttft_n": len(sink["ttft"]), "itl_n": len(sink["itl"])}
    return out


async def _raw_stream(host: str, port: int, request: bytes, stop: asyncio.Event, ready: asyncio.Event,
                      ttft: list[float], itl: list[float], counts: dict[str, int]) -> None:
    # Warm-up like kvdiag's client: open the keep-alive connection with one GET /health, then
    # wait for every stream to be connected before the first timed request.
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    writer.write(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    if length:
        await asyncio.wait_for(reader.readexactly(int(length.group(1))), 5)
    counts["warm"] -= 1
    if counts["warm"] == 0:
        ready.set()
    await asyncio.wait_for(ready.wait(), 10)
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            writer.write(request)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            if b" 200 " not in head.split(b"\r\n", 1)[0]:
                counts["errors"] += 1
                return
            buf = b""
            last: float | None = None
            while True:
                size = int((await asyncio.wait_for(reader.readline(), 30)).strip().split(b";")[0], 16)
                if size == 0:
                    await asyncio.wait_for(reader.readline(), 30)
                    break
                data = await asyncio.wait_for(reader.readexactly(size + 2), 30)
                now = time.monotonic()
                n, buf = _token_events(buf + data[:-2])
                for _ in range(n):
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        itl.append(now - last)
                    last = now
                    counts["tokens"] += 1
    finally:
        writer.close()


def client_raw(url: str, concurrency: int, duration: float, max_tokens: int, start_at: float) -> dict[str, Any]:
    m = re.match(r"http://([^:/]+):(\d+)", url)
    assert m, url
    host, port = m.group(1), int(m.group(2))
    payload = json.dumps(_body(max_tokens)).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    ttft: list[float] = []
    itl: list[float] = []
    counts = {"tokens": 0, "errors": 0, "warm": concurrency}

    async def main() -> None:
        stop, ready = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(_raw_stream(host, port, request, stop, ready, ttft, itl, counts))
                 for _ in range(concurrency)]
        await asyncio.sleep(duration)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    _wait_until(start_at)
    cpu0 = time.process_time()
    asyncio.run(main())
    cpu = time.process_time() - cpu0
    return {"ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "itl_p50": _pct(itl, 50),
            "itl_p99": _pct(itl, 99), "tokens": counts["tokens"], "ttft_n": len(ttft), "itl_n": len(itl),
            "cpu_s": cpu, "errors": counts["errors"]}


# --------------------------------------------------------------------------------------------------
# server histograms
_BUCKET = re.compile(r'^(?P<name>vllm:[a-z_]+)_bucket\{[^}]*le="(?P<le>[^"]+)"[^}]*\}\s+(?P<v>\S+)')


def _buckets(text: str, name: str) -> list[tuple[float, float]]:
    out: dict[float, float] = {}
    for line in text.splitlines():
        m = _BUCKET.match(line)
        if m and m.group("name") == name:
            le = math.inf if m.group("le") == "+Inf" else float(m.group("le"))
            out[le] = out.get(le, 0.0) + float(m.group("v"))
    return sorted(out.items())


def _hist_quantile(before: str, after: str, name: str, q: float) -> float | None:
    """Prometheus histogram_quantile over the buckets' increase between two scrapes."""
    b0 = dict(_buckets(before, name))
    delta = [(le, c - b0.get(le, 0.0)) for le, c in _buckets(after, name)]
    if not delta or delta[-1][1] <= 0:
        return None
    rank = q * delta[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in delta:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0.0)
        prev_le, prev_c = le, c
    return None


# --------------------------------------------------------------------------------------------------
def _err(a: float | None, b: float | None) -> float:
    if a is None or b is None or b == 0:
        return float("nan")
    return abs(a - b) / b


def _phase(url: str, args: argparse.Namespace, tap: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """kvdiag's client and the raw client, started together; returns (kvdiag, raw)."""
    start_at = time.time() + 2.0
    common = ["--url", url, "--concurrency", str(args.concurrency), "--duration", str(args.duration),
              "--max-tokens", str(args.max_tokens), "--start-at", str(start_at)]
    procs = {
        "kvdiag": subprocess.Popen([sys.executable, __file__, "--client", "kvdiag", *common]
                                   + (["--tap"] if tap else []), stdout=subprocess.PIPE, text=True, cwd=ROOT),
        "raw": subprocess.Popen([sys.executable, __file__, "--client", "raw", *common],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT),
    }
    results: dict[str, dict[str, Any]] = {}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=args.duration + 120)
        if p.returncode != 0:
            raise SystemExit(f"{name} client failed (exit {p.returncode})")
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results["kvdiag"], results["raw"]


# --------------------------------------------------------------------------------------------------
# --vllm: kvdiag's soak client vs `vllm bench serve` on one real vLLM server, in alternating rounds
ALL_KEYS = (*KEYS, "ttft_mean", "itl_mean")
VLLM_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "64M",
             "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
# Three clients per cycle, the order rotated so that none always runs first, after kvdiag, or last.
ORDERS = (("bench", "kvdiag", "bench2"), ("kvdiag", "bench2", "bench"), ("bench2", "bench", "kvdiag"))
SAME_READ_S = 0.0005   # an ITL gap this short: two token events the client took from one socket read
TAIL_S = 0.025         # a bucket bound of vLLM's ITL histogram: the share of gaps above it, client vs server


def _stats(ttft: list[float], itl: list[float]) -> dict[str, float | None]:
    return {"ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "itl_p50": _pct(itl, 50),
            "itl_p99": _pct(itl, 99), "ttft_mean": statistics.fmean(ttft) if ttft else None,
            "itl_mean": statistics.fmean(itl) if itl else None,
            "same_read": sum(1 for g in itl if g < SAME_READ_S) / len(itl) if itl else None,
            "tail": sum(1 for g in itl if g > TAIL_S) / len(itl) if itl else None}


_SUMCOUNT = re.compile(r"^vllm:(?P<name>time_to_first_token|inter_token_latency)_seconds_(?P<kind>sum|count)"
                       r"\{[^}]*\}\s+(?P<v>\S+)", re.M)


def _server_totals(url: str) -> dict[str, float]:
    """The server's own TTFT and ITL histograms' running sum and count (vLLM measures them in the API server)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    out: dict[str, float] = {}
    for m in _SUMCOUNT.finditer(text):
        key = f"{m.group('name')}_{m.group('kind')}"
        out[key] = out.get(key, 0.0) + float(m.group("v"))
    for le, count in _buckets(text, "vllm:inter_token_latency_seconds"):
        if le == TAIL_S:
            out["itl_le_tail"] = count
    return out


def _server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    res: dict[str, float | None] = {}
    for name, key in (("time_to_first_token", "srv_ttft_mean"), ("inter_token_latency", "srv_itl_mean")):
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        res[key] = (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / n if n > 0 else None
    n = after.get("inter_token_latency_count", 0.0) - before.get("inter_token_latency_count", 0.0)
    under = after.get("itl_le_tail", 0.0) - before.get("itl_le_tail", 0.0)
    res["srv_tail"] = 1.0 - under / n if n > 0 else None
    return res


def client_kvdiag_vllm(url: str, model: str, concurrency: int, num: int, input_len: int, max_tokens: int,
                       seed: int) -> dict[str, Any]:
    """kvdiag's LoadGenerator sending exactly ``num`` requests; its raw samples, for the parent to reduce."""
    import random

    from kvdiag.load.loadgen import LoadGenerator
    from kvdiag.load.request import LoadConfig
    from kvdiag.load.stream import RequestStatus

    rnd = random.Random(seed)
    prompt = [rnd.randrange(4, 500) for _ in range(input_len)]   # ids past the special tokens
    cfg = LoadConfig(base_url=url, model=model, concurrency=concurrency, max_tokens=max_tokens, prompt=prompt,
                     max_requests=num, keep_records=num + concurrency)
    lg = LoadGenerator(cfg)

    async def drive() -> float:
        cpu0 = time.process_time()
        lg.start()
        while lg.ok + lg.failed + lg.timed_out < num:
            await asyncio.sleep(0.05)
        cpu = time.process_time() - cpu0
        await lg.stop()
        return cpu

    cpu = asyncio.run(drive())
    ok = [r for r in lg.records if r.status is RequestStatus.OK and r.ttft_s is not None]
    # TTFT from the moment the client began the request (bench's start point; kvdiag builds nothing per
    # request, so this is just before the write), and from the write (what `kvdiag soak` reports).
    return {"ttft": [r.ttft_s + (r.start - (r.issued if r.issued is not None else r.start)) for r in ok
                     if r.ttft_s is not None],
            "ttft_sent": [r.ttft_s for r in ok if r.ttft_s is not None],
            "itl": [g for r in ok for g in r.itl_s],
            "ok": lg.ok, "failed": lg.failed + lg.timed_out,
            "parse_failures": sum(1 for r in lg.records if r.error and ("SSE" in r.error or "JSON" in r.error)),
            "tokens": sum(r.usage_tokens or r.tokens for r in ok), "cpu_s": cpu, "requests": num}


def _stat_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_bench(vllm_exe: str, url: str, model: str, concurrency: int, num: int, input_len: int, max_tokens: int,
              seed: int, out_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """`vllm bench serve`: its per-request samples (--save-detailed), its own summary, load-window CPU."""
    name = f"bench-{uuid.uuid4().hex[:8]}.json"
    argv = [vllm_exe, "bench", "serve", "--backend", "openai", "--base-url", url, "--model", model,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(max_tokens),
            "--num-prompts", str(num), "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", name]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    cpu_start = cpu_end = None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if "Starting main benchmark run" in line:
            cpu_start = _stat_cpu(proc.pid)
        elif "Serving Benchmark Result" in line and cpu_start is not None:
            cpu_end = _stat_cpu(proc.pid)
    proc.wait(timeout=120)
    if proc.returncode != 0 or cpu_start is None or cpu_end is None:
        raise SystemExit("vllm bench serve failed:\n" + "\n".join(lines[-30:]))
    path = out_dir / name
    res = json.loads(path.read_text())
    path.unlink()
    good = [i for i, e in enumerate(res["errors"]) if not e]
    return {"ttft": [res["ttfts"][i] for i in good], "itl": [g for i in good for g in res["itls"][i]],
            "own": {"ttft_p50": res["median_ttft_ms"] / 1000, "ttft_p99": res["p99_ttft_ms"] / 1000,
                    "itl_p50": res["median_itl_ms"] / 1000, "itl_p99": res["p99_itl_ms"] / 1000},
            "ok": res["completed"], "failed": res["failed"], "parse_failures": None,
            "tokens": res["total_output_tokens"], "prompt_tokens": res["total_input_tokens"],
            "cpu_s": cpu_end - cpu_start, "requests": num}


def bench_model(vllm_exe: str, layers: int, hidden: int) -> str:
    """The benchmark's model: scripts/make_tiny_llama.py at this size, cached under ~/.cache/kvdiag
    (2 layers, hidden 128: CI's model, the one scripts/setup_vllm_cpu.sh writes)."""
    if (layers, hidden) == (2, 128):
        from kvdiag.launch.vllm import default_model

        return default_model()
    out = Path(os.path.expanduser(f"~/.cache/kvdiag/tiny-llama-{layers}x{hidden}"))
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return str(out)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    r = subprocess.run([str(Path(vllm_exe).parent / "python"), str(ROOT / "scripts" / "make_tiny_llama.py"), str(tmp),
                        "--layers", str(layers), "--hidden", str(hidden)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"make_tiny_llama.py failed:\n{r.stderr[-2000:]}")
    try:
        tmp.rename(out)
    except OSError:   # another run wrote it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def main_vllm(args: argparse.Namespace) -> int:
    import tempfile

    import httpx

    from kvdiag.launch.engines import plan_engine
    from kvdiag.launch.process import EngineProcess, ProcessSet
    from kvdiag.launch.vllm import find_vllm
    from kvdiag.ports import free_port
    from kvdiag.scenario.models import EngineSpec, VllmParams

    t_begin = time.monotonic()
    load0 = os.getloadavg()
    vllm_exe = find_vllm(None)
    model = bench_model(vllm_exe, args.layers, args.hidden)
    spec = EngineSpec(name="bench", kind="vllm", model=model, allocator="external", vllm=VllmParams(args=VLLM_ARGS))
    runs: dict[str, list[dict[str, Any]]] = {"kvdiag": [], "bench": [], "bench2": []}
    with tempfile.TemporaryDirectory(prefix="kvdiag-bench-soak-") as tmp, ProcessSet(grace_s=5) as procs:
        plan = plan_engine(spec, free_port(), "unused", 96.0, run_dir=procs.run_dir())
        env = procs.env_for(plan.env)
        engine = EngineProcess("bench", plan.argv, env, Path(tmp) / "server.log")
        procs.start(engine)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{plan.url}/health", timeout=1.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if not engine.alive():
                raise SystemExit("vLLM server exited:\n" + (Path(tmp) / "server.log").read_text()[-3000:])
            time.sleep(0.5)
        else:
            raise SystemExit("vLLM server did not come up in 300 s")
        with httpx.Client(trust_env=False, timeout=60) as c:   # the server's first-request costs, outside every round
            for _ in range(3):
                c.post(f"{plan.url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8})
        print(f"vLLM CPU server up at {plan.url} ({model}, {args.layers} layers, hidden {args.hidden}) after "
              f"{time.monotonic() - t_begin:.0f} s; {args.rounds} cycles of bench / kvdiag / bench2 (order rotated), "
              f"one client at a time, {args.num_prompts} requests each, {args.concurrency} at a time, "
              f"{args.input_len} prompt + {args.max_tokens} output tokens (ignore_eos), seed {args.seed} every run")
        client_argv = [sys.executable, __file__, "--client", "kvdiag-vllm", "--url", plan.url, "--model", model,
                       "--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
                       "--input-len", str(args.input_len), "--max-tokens", str(args.max_tokens),
                       "--seed", str(args.seed)]
        bench_env = dict(env, PYTHONUNBUFFERED="1")
        cycle_s: list[float] = []
        for cycle in range(args.rounds):
            # CONTRACT.md: under 5 minutes. On a busy machine, stop after the last cycle that still fits
            # (at least 3: each order once); the table says how many ran.
            if cycle >= 3 and time.monotonic() - t_begin + max(cycle_s) > args.budget_s:
                print(f"stopping after {cycle} cycles: another would end past the {args.budget_s:g} s budget")
                break
            t_cycle = time.monotonic()
            for who in ORDERS[cycle % len(ORDERS)]:
                srv0 = _server_totals(plan.url)
                if who == "kvdiag":
                    p = subprocess.run(client_argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
                    if p.returncode != 0:
                        raise SystemExit(f"kvdiag client failed: {p.stderr[-2000:]}")
                    run = json.loads(p.stdout.strip().splitlines()[-1])
                else:
                    run = run_bench(vllm_exe, plan.url, model, args.concurrency, args.num_prompts, args.input_len,
                                    args.max_tokens, args.seed, Path(tmp), bench_env)
                run.update(_stats(run["ttft"], run["itl"]))
                run.update(_server_means(srv0, _server_totals(plan.url)))
                run["cpu_per_req"] = run["cpu_s"] / run["requests"]
                runs[who].append(run)
            cycle_s.append(time.monotonic() - t_cycle)
    load1 = os.getloadavg()
    cycles = len(runs["kvdiag"])

    def ms(v: float | None) -> str:
        return f"{'-':>8}" if v is None else f"{v * 1000:8.2f}"

    print()
    print(f"{'run':<10} {'TTFT p50':>8} {'TTFT p99':>8} {'ITL p50':>8} {'ITL p99':>8} {'same-read':>9} "
          f"{'ok/fail':>8} {'tokens':>6} {'CPU/req':>8} {'ITL mean':>8} {'srv ITL':>8} {'TTFT mean':>9} "
          f"{'srv TTFT':>8} {'>25ms cli/srv':>13}   (ms; srv: the server's own figure, same run)")
    for cycle in range(cycles):
        for who in ORDERS[cycle % len(ORDERS)]:
            r = runs[who][cycle]
            print(f"{cycle} {who:<8} {ms(r['ttft_p50'])} {ms(r['ttft_p99'])} {ms(r['itl_p50'])} {ms(r['itl_p99'])} "
                  f"{r['same_read'] * 100:8.1f}% {str(r['ok']) + '/' + str(r['failed']):>8} {r['tokens']:>6} "
                  f"{ms(r['cpu_per_req'])} {ms(r['itl_mean'])} {ms(r['srv_itl_mean'])} {ms(r['ttft_mean']):>9} "
                  f"{ms(r['srv_ttft_mean'])} {r['tail'] * 100:6.2f}/{(r['srv_tail'] or 0) * 100:5.2f}%")
    med = {who: {key: statistics.median(r[key] for r in rs)
                 for key in (*ALL_KEYS, "same_read", "cpu_per_req", "tail", "srv_tail")}
           for who, rs in runs.items()}
    # How far each client's mean is from the server's own mean over the same run: the client's measurement error,
    # free of the server's run-to-run variation (vLLM's ITL is per token, the clients' per event: equal when no
    # event carries more than one token, i.e. tokens == events).
    for who, rs in runs.items():
        for key in ("itl", "ttft"):
            med[who][f"{key}_vs_srv"] = statistics.median(
                r[f"{key}_mean"] / r[f"srv_{key}_mean"] - 1 for r in rs if r[f"srv_{key}_mean"])
    sent = statistics.median(_pct(r["ttft_sent"], 50) for r in runs["kvdiag"])
    own = max(abs(r["own"][k] - r[k]) for r in runs["bench"] + runs["bench2"] for k in KEYS)
    diff = {key: _err(med["kvdiag"][key], med["bench"][key]) for key in ALL_KEYS}
    floor = {key: _err(med["bench2"][key], med["bench"][key]) for key in ALL_KEYS}
    print()
    print(f"median over {cycles} rounds  {'kvdiag':>8} {'bench':>8} {'bench2':>8}   {'diff':>6} "
          f"{'noise floor':>11}")
    for key in ALL_KEYS:
        print(f"{key + ' ms':<26} {ms(med['kvdiag'][key])} {ms(med['bench'][key])} {ms(med['bench2'][key])}   "
              f"{diff[key]:6.3f} {floor[key]:11.3f}")
    cpu_ratio = med["kvdiag"]["cpu_per_req"] / med["bench"]["cpu_per_req"]
    parse = sum(r["parse_failures"] for r in runs["kvdiag"])
    bench_failed = sum(r["failed"] for r in runs["bench"] + runs["bench2"])
    k_failed = sum(r["failed"] for r in runs["kvdiag"])
    print(f"{'client CPU per request ms':<26} {ms(med['kvdiag']['cpu_per_req'])} {ms(med['bench']['cpu_per_req'])} "
          f"{ms(med['bench2']['cpu_per_req'])}   cpu_ratio {cpu_ratio:.3f} (kvdiag / bench)")
    print(f"{'ITL mean vs server mean':<26} {med['kvdiag']['itl_vs_srv']:+8.3f} {med['bench']['itl_vs_srv']:+8.3f} "
          f"{med['bench2']['itl_vs_srv']:+8.3f}   (client mean / the server's own mean over the same run - 1)")
    print(f"{'TTFT mean vs server mean':<26} {med['kvdiag']['ttft_vs_srv']:+8.3f} {med['bench']['ttft_vs_srv']:+8.3f} "
          f"{med['bench2']['ttft_vs_srv']:+8.3f}")
    print(f"{'ITL gaps > 25 ms, client':<26} {med['kvdiag']['tail'] * 100:7.2f}% {med['bench']['tail'] * 100:7.2f}% "
          f"{med['bench2']['tail'] * 100:7.2f}%   (the tail, against the server's own histogram below)")
    print(f"{'ITL > 25 ms, server':<26} {med['kvdiag']['srv_tail'] * 100:7.2f}% "
          f"{med['bench']['srv_tail'] * 100:7.2f}% {med['bench2']['srv_tail'] * 100:7.2f}%")
    print(f"{'same-read ITL gaps':<26} {med['kvdiag']['same_read'] * 100:7.1f}% "
          f"{med['bench']['same_read'] * 100:7.1f}% {med['bench2']['same_read'] * 100:7.1f}%   "
          f"(gaps < {SAME_READ_S * 1000:g} ms: events taken from one read)")
    print(f"failures: kvdiag {k_failed} (SSE parse failures {parse}), bench {bench_failed}; output tokens per run "
          f"kvdiag {sorted({r['tokens'] for r in runs['kvdiag']})}, bench "
          f"{sorted({r['tokens'] for r in runs['bench'] + runs['bench2']})}; prompt tokens per run kvdiag "
          f"{args.num_prompts * args.input_len}, bench {sorted({r['prompt_tokens'] for r in runs['bench']})}")
    print(f"kvdiag TTFT p50 from the socket write (what `kvdiag soak` reports): {ms(sent)} ms; bench's own summary "
          f"figures reproduced from its samples to within {own * 1000:.4f} ms")
    print(f"load average (1 min) before {load0[0]:.2f}, after {load1[0]:.2f}; wall {time.monotonic() - t_begin:.0f} s")
    print("Definitions (both clients, computed here by one function on the raw samples, numpy's linear percentile):")
    print("  TTFT: from the client beginning the request (bench: before aiohttp builds it; kvdiag: before its "
          "pre-built request is written) to the first SSE event with a choice (its text may be empty).")
    print("  ITL: the gaps between consecutive such events of one request, per event (an event that carries "
          "several tokens is one gap, not split), pooled over the run's requests.")
    print("diff = |kvdiag - bench| / bench of the medians over rounds; noise floor = |bench2 - bench| / bench, the "
          "same reference run twice in the same alternation; target: diffs <= 0.05, cpu_ratio <= 1, 0 parse failures")
    print(f"RESULT ttft_p50_err={diff['ttft_p50']:.4f} itl_p50_err={diff['itl_p50']:.4f} "
          f"ttft_p99_err={diff['ttft_p99']:.4f} itl_p99_err={diff['itl_p99']:.4f} cpu_ratio={cpu_ratio:.3f} "
          f"noise_ttft_p50={floor['ttft_p50']:.4f} noise_itl_p50={floor['itl_p50']:.4f} "
          f"noise_ttft_p99={floor['ttft_p99']:.4f} noise_itl_p99={floor['itl_p99']:.4f} "
          f"ttft_mean_err={diff['ttft_mean']:.4f} itl_mean_err={diff['itl_mean']:.4f} "
          f"itl_vs_server_kvdiag={med['kvdiag']['itl_vs_srv']:.4f} "
          f"itl_vs_server_bench={med['bench']['itl_vs_srv']:.4f} "
          f"parse_failures={parse} kvdiag_failed={k_failed} bench_failed={bench_failed} rounds={cycles}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=25.0, help="seconds of load per phase (two phases)")
    ap.add_argument("--concurrency", type=int, default=16, help="streams per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=20.0, help="the sim's decode step (the ITL it produces)")
    ap.add_argument("--vllm", action="store_true", help="kvdiag's soak client vs `vllm bench serve` on real vLLM")
    ap.add_argument("--rounds", type=int, default=6,
                    help="--vllm: cycles of bench / kvdiag / bench2, one client at a time (order rotated)")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="--vllm: start no cycle (after the third) that would end past this many seconds")
    ap.add_argument("--num-prompts", type=int, default=48, help="--vllm: requests per run")
    ap.add_argument("--input-len", type=int, default=64, help="--vllm: prompt tokens")
    ap.add_argument("--layers", type=int, default=8, help="--vllm: the model's layers (scripts/make_tiny_llama.py)")
    ap.add_argument("--hidden", type=int, default=768, help="--vllm: the model's hidden size")
    ap.add_argument("--seed", type=int, default=0, help="--vllm: the prompt set's seed, the same in every run")
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--client", choices=["kvdiag", "raw", "kvdiag-vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--tap", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client == "kvdiag-vllm":
        print(json.dumps(client_kvdiag_vllm(args.url, args.model, args.concurrency, args.num_prompts, args.input_len,
                                            args.max_tokens, args.seed)))
        return 0
    if args.vllm:
        if args.concurrency == 16:
            args.concurrency = 4
        return main_vllm(args)
    if args.client == "kvdiag":
        print(json.dumps(client_kvdiag(args.url, args.concurrency, args.duration, args.max_tokens, args.start_at,
                                       args.tap)))
        return 0
    if args.client == "raw":
        print(json.dumps(client_raw(args.url, args.concurrency, args.duration, args.max_tokens, args.start_at)))
        return 0

    import httpx

    from kvdiag.allocator import remove_device_files
    from kvdiag.sim.harness import SimProcess

    dev = f"kvbench-soak-{uuid.uuid4().hex[:8]}"
    log = Path("/tmp") / f"{dev}.log"
    try:
        with SimProcess(log, allocator="fixed", device_name=dev, max_running=4 * args.concurrency,
                        step_ms=args.step_ms, extra=["--disable-uvicorn-access-log"]) as sp:
            if not sp.wait_healthy(60):
                print(sp.log_text()[-2000:], file=sys.stderr)
                return 1
            with httpx.Client(trust_env=False, timeout=30) as c:
                for _ in range(3):   # the server's own first-request costs, outside both phases
                    c.post(f"{sp.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
                before = c.get(f"{sp.url}/metrics").text
            k_tap, raw_a = _phase(sp.url, args, tap=True)
            k_cpu, raw_b = _phase(sp.url, args, tap=False)
            with httpx.Client(trust_env=False, timeout=30) as c:
                after = c.get(f"{sp.url}/metrics").text
    finally:
        remove_device_files(dev)
        log.unlink(missing_ok=True)

    ref = k_tap["tap"]
    server = {
        "ttft_p50": _hist_quantile(before, after, "vllm:time_to_first_token_seconds", 0.5),
        "ttft_p99": _hist_quantile(before, after, "vllm:time_to_first_token_seconds", 0.99),
        "itl_p50": _hist_quantile(before, after, "vllm:inter_token_latency_seconds", 0.5),
        "itl_p99": _hist_quantile(before, after, "vllm:inter_token_latency_seconds", 0.99),
    }

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.3f}"

    print(f"soak accuracy: sim step {args.step_ms:g} ms, {args.concurrency} kvdiag streams + {args.concurrency} "
          f"raw-client streams at once, max_tokens {args.max_tokens}, {args.duration:g} s per phase")
    print()
    print("phase A: kvdiag's figures vs the socket tap under them (same requests, same tokens)")
    print(f"{'metric':<9} {'kvdiag ms':>10} {'tap ms':>10} {'rel err':>8} | {'raw client ms':>13} "
          f"{'server hist ms':>14}")
    errs: dict[str, float] = {}
    for key in KEYS:
        errs[key] = _err(k_tap[key], ref[key])
        print(f"{key:<9} {ms(k_tap[key]):>10} {ms(ref[key]):>10} {errs[key]:8.4f} | {ms(raw_a[key]):>13} "
              f"{ms(server[key]):>14}")
    print(f"{'samples':<9} TTFT {k_tap['ttft_n']} / {ref['ttft_n']}, ITL {k_tap['itl_n']} / {ref['itl_n']}, "
          f"tokens {k_tap['tokens']} / {ref['tokens']} (kvdiag / tap); raw client: {raw_a['tokens']} tokens")
    print("  (raw client: other requests to the same server, so sampling differs; server histograms are "
          "bucketed: 10/25 ms ITL buckets, 20/40 ms TTFT buckets)")
    print()
    print("phase B: CPU per received token, tap off, kvdiag's client and the raw client at once")
    k_per = k_cpu["cpu_s"] / max(1, k_cpu["tokens"])
    r_per = raw_b["cpu_s"] / max(1, raw_b["tokens"])
    cpu_ratio = k_per / r_per if r_per > 0 else float("nan")
    print(f"{'client':<9} {'cpu s':>7} {'tokens':>8} {'us/token':>9} {'TTFT p50/p99 ms':>18} {'ITL p50/p99 ms':>16}")
    for name, r in (("kvdiag", k_cpu), ("raw", raw_b)):
        per = r["cpu_s"] / max(1, r["tokens"]) * 1e6
        print(f"{name:<9} {r['cpu_s']:>7.2f} {r['tokens']:>8} {per:>9.1f} "
              f"{ms(r['ttft_p50']) + '/' + ms(r['ttft_p99']):>18} {ms(r['itl_p50']) + '/' + ms(r['itl_p99']):>16}")
    print("cpu_ratio = (kvdiag client CPU s / its tokens) / (raw-socket client CPU s / its tokens)")
    print(f"RESULT ttft_p50_err={errs['ttft_p50']:.4f} itl_p50_err={errs['itl_p50']:.4f} "
          f"ttft_p99_err={errs['ttft_p99']:.4f} itl_p99_err={errs['itl_p99']:.4f} cpu_ratio={cpu_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
