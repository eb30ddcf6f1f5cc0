"""Benchmark: how accurate (and how cheap) kvdiag's soak load generator's TTFT/ITL figures are.

Server: one simulated engine (`python -m kvdiag.sim serve`, fixed allocator, a KV pool that never
fills, --step-ms 20), so tokens come at a known pace and nothing stalls.

Measured in the same run, at the same time, against that server (two child processes started
together, each with --concurrency streams of /v1/completions, stream=true, ignore_eos):
- subject: kvdiag.soak.loadgen.LoadGenerator (httpx, the incremental SSE parser, per-request records);
- reference: a deliberately minimal client written here on raw asyncio sockets (hand-decoded
  HTTP/1.1 chunked body, events split on blank lines, one keep-alive connection per stream),
  stamping each event with the time its HTTP chunk arrived, exactly as kvdiag does.
Both see the same server under the same load; the server's own histograms
(vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, bucketed, so coarse) are
printed as a third opinion.

Errors are relative: |kvdiag - reference| / reference, for TTFT and ITL p50 and p99.
cpu_ratio = (kvdiag client CPU seconds / tokens it received) / (reference client CPU seconds /
tokens it received): CPU (user+sys, time.process_time of each client process over its load
window) per received token, so the two are comparable even if their token counts differ.

Prints a table and ends with
`RESULT ttft_p50_err=... itl_p50_err=... ttft_p99_err=... itl_p99_err=... cpu_ratio=...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Tell me a story about a page allocator."


# --------------------------------------------------------------------------------------------------
# shared
def _pct(values: list[float], q: float) -> float | None:
    from kvdiag.soak.stats import percentile

    return percentile(sorted(values), q)


def _body(max_tokens: int) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


def _wait_until(t_wall: float) -> None:
    delay = t_wall - time.time()
    if delay > 0:
        time.sleep(delay)


# --------------------------------------------------------------------------------------------------
# subject client: kvdiag's load generator
def client_kvdiag(url: str, concurrency: int, duration: float, max_tokens: int, start_at: float) -> dict[str, Any]:
    from kvdiag.soak.loadgen import LoadConfig, LoadGenerator

    cfg = LoadConfig(base_url=url, concurrency=concurrency, max_tokens=max_tokens, prompt=PROMPT)
    _wait_until(start_at)
    cpu0 = time.process_time()
    lg = LoadGenerator(cfg)
    summary = asyncio.run(lg.run_for(duration))
    cpu = time.process_time() - cpu0
    return {"ttft_p50": summary.ttft.p50_s, "ttft_p99": summary.ttft.p99_s, "itl_p50": summary.itl.p50_s,
            "itl_p99": summary.itl.p99_s, "tokens": summary.tokens, "requests_ok": summary.requests_ok,
            "ttft_n": summary.ttft.count, "itl_n": summary.itl.count, "cpu_s": cpu,
            "errors": summary.requests_failed + summary.requests_timed_out}


# --------------------------------------------------------------------------------------------------
# reference client: raw sockets, nothing shared with kvdiag
async def _ref_stream(host: str, port: int, request: bytes, stop: asyncio.Event, ttft: list[float],
                      itl: list[float], counts: dict[str, int]) -> None:
    # Connect inside the first request's timing, as kvdiag's client (and vllm bench) does.
    t0 = time.monotonic()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    first = True
    try:
        while not stop.is_set():
            if not first:
                t0 = time.monotonic()
            first = False
            writer.write(request)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            if b" 200 " not in head.split(b"\r\n", 1)[0]:
                counts["errors"] += 1
                return
            buf = b""
            last: float | None = None
            while True:
                size_line = await asyncio.wait_for(reader.readline(), 30)
                size = int(size_line.strip().split(b";")[0], 16)
                if size == 0:
                    await asyncio.wait_for(reader.readline(), 30)
                    break
                data = await asyncio.wait_for(reader.readexactly(size + 2), 30)
                now = time.monotonic()
                buf += data[:-2]
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    if not ev.startswith(b"data: {") or b'"choices":[]' in ev:
                        continue
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        itl.append(now - last)
                    last = now
                    counts["tokens"] += 1
            counts["ok"] += 1
    finally:
        writer.close()


def client_reference(url: str, concurrency: int, duration: float, max_tokens: int,
                     start_at: float) -> dict[str, Any]:
    m = re.match(r"http://([^:/]+):(\d+)", url)
    assert m, url
    host, port = m.group(1), int(m.group(2))
    payload = json.dumps(_body(max_tokens)).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: keep-alive\r\n\r\n").encode() + payload
    ttft: list[float] = []
    itl: list[float] = []
    counts = {"tokens": 0, "ok": 0, "errors": 0}

    async def main() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_ref_stream(host, port, request, stop, ttft, itl, counts))
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
            "itl_p99": _pct(itl, 99), "tokens": counts["tokens"], "requests_ok": counts["ok"],
            "ttft_n": len(ttft), "itl_n": len(itl), "cpu_s": cpu, "errors": counts["errors"]}


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
    b1 = _buckets(after, name)
    delta = [(le, c - b0.get(le, 0.0)) for le, c in b1]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load (both clients at once)")
    ap.add_argument("--concurrency", type=int, default=16, help="streams per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=20.0, help="the sim's decode step (the ITL it produces)")
    ap.add_argument("--client", choices=["kvdiag", "reference"], help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        fn = client_kvdiag if args.client == "kvdiag" else client_reference
        print(json.dumps(fn(args.url, args.concurrency, args.duration, args.max_tokens, args.start_at)))
        return 0

    import httpx

    from kvdiag.sim.harness import SimProcess, remove_device_files

    dev = f"kvbench-soak-{uuid.uuid4().hex[:8]}"
    log = Path("/tmp") / f"{dev}.log"
    results: dict[str, dict[str, Any]] = {}
    try:
        with SimProcess(log, allocator="fixed", device_name=dev, max_running=4 * args.concurrency,
                        step_ms=args.step_ms, extra=["--disable-uvicorn-access-log"]) as sp:
            if not sp.wait_healthy(60):
                print(sp.log_text()[-2000:], file=sys.stderr)
                return 1
            # warm-up: one short burst so connection setup and first-request costs don't land in the window
            with httpx.Client(trust_env=False, timeout=30) as c:
                for _ in range(3):
                    c.post(f"{sp.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
                before = c.get(f"{sp.url}/metrics").text
            start_at = time.time() + 2.0
            procs = {name: subprocess.Popen(
                [sys.executable, __file__, "--client", name, "--url", sp.url, "--concurrency", str(args.concurrency),
                 "--duration", str(args.duration), "--max-tokens", str(args.max_tokens), "--start-at", str(start_at)],
                stdout=subprocess.PIPE, text=True, cwd=ROOT) for name in ("kvdiag", "reference")}
            for name, p in procs.items():
                out, _ = p.communicate(timeout=args.duration + 120)
                if p.returncode != 0:
                    print(f"{name} client failed (exit {p.returncode})", file=sys.stderr)
                    return 1
                results[name] = json.loads(out.strip().splitlines()[-1])
            with httpx.Client(trust_env=False, timeout=30) as c:
                after = c.get(f"{sp.url}/metrics").text
    finally:
        remove_device_files(dev)
        log.unlink(missing_ok=True)

    k, r = results["kvdiag"], results["reference"]
    server = {
        "ttft_p50": _hist_quantile(before, after, "vllm:time_to_first_token_seconds", 0.5),
        "ttft_p99": _hist_quantile(before, after, "vllm:time_to_first_token_seconds", 0.99),
        "itl_p50": _hist_quantile(before, after, "vllm:inter_token_latency_seconds", 0.5),
        "itl_p99": _hist_quantile(before, after, "vllm:inter_token_latency_seconds", 0.99),
    }

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:9.3f}"

    print(f"soak accuracy: sim step {args.step_ms:g} ms, {args.concurrency} streams per client x 2 clients, "
          f"max_tokens {args.max_tokens}, {args.duration:g} s, both clients at the same time")
    print(f"{'metric':<10} {'kvdiag ms':>10} {'reference ms':>13} {'rel err':>8} {'server hist ms':>15}")
    errs: dict[str, float] = {}
    for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
        errs[key] = _err(k[key], r[key])
        print(f"{key:<10} {ms(k[key]):>10} {ms(r[key]):>13} {errs[key]:8.3f} {ms(server[key]):>15}")
    print(f"{'samples':<10} TTFT {k['ttft_n']} / {r['ttft_n']}, ITL {k['itl_n']} / {r['itl_n']} (kvdiag / reference)")
    print(f"{'tokens':<10} {k['tokens']:>10} {r['tokens']:>13}   ({k['tokens'] / args.duration:.0f} / "
          f"{r['tokens'] / args.duration:.0f} tok/s; errors {k['errors']} / {r['errors']})")
    print(f"{'cpu s':<10} {k['cpu_s']:>10.2f} {r['cpu_s']:>13.2f}")
    k_per = k["cpu_s"] / max(1, k["tokens"])
    r_per = r["cpu_s"] / max(1, r["tokens"])
    cpu_ratio = k_per / r_per if r_per > 0 else float("nan")
    print(f"{'cpu us/tok':<10} {k_per * 1e6:>10.1f} {r_per * 1e6:>13.1f}")
    print("cpu_ratio = (kvdiag client CPU s / its tokens) / (reference raw-socket client CPU s / its tokens)")
    print(f"RESULT ttft_p50_err={errs['ttft_p50']:.4f} itl_p50_err={errs['itl_p50']:.4f} "
          f"ttft_p99_err={errs['ttft_p99']:.4f} itl_p99_err={errs['itl_p99']:.4f} cpu_ratio={cpu_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
