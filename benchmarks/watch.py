"""Benchmark: what `kvdiag watch` costs a real vLLM CPU server, and how fast it names a stall.

One real `vllm serve` (vLLM CPU, the tiny model, kvdiag's plugin with the fixed allocator; started by this
script, not by kvdiag) under a steady streaming load (4 streams of 120-147 tokens, --max-num-seqs 1):

1. overhead: alternating rounds of the same load with one `kvdiag watch --url` beside it (its default 1 s
   period) running, and SIGSTOPped (kvdiag's own process) in the rounds without; tokens/s counted by the
   client in each round, the order alternating per pair (a slow drift of the machine cancels). The overhead is
   1 - the median over pairs of (with / without) of the same pair, with a bootstrap 95 % interval over the
   pairs; the noise is the spread of the rounds without. Beside it, by accounting: the watch's own CPU and the
   server's CPU (API server + EngineCore) per token, with and without, read from /proc.
   A 1 % effect is below one round's noise here (the tiny model makes the API server the bottleneck and
   throughput swings 5-8 % between rounds), so the same alternation also runs with the watch looking ten
   times as often (--amplify 0.1: the fastest period the CLI takes), and that overhead scaled back to the
   default period (x 0.1) is the measurement, with its interval. And by accounting, before the load starts:
   the API server's CPU per look (one GET /metrics and one GET /health, 100 of each on the idle server).
2. stall onset -> verdict, on a second server whose EngineCore steps take a real model's time
   (KVDIAG_VLLM_STEP_DELAY_MS, so requests queue in it as in production): a watch left running (window
   --window, cooldown 0) while the EngineCore is SIGSTOPped --stops times (each named `stopped`, then SIGCONT:
   the server recovers); then a --once watch while the EngineCore falls into the GIL cycle
   KVDIAG_VLLM_STALL_AFTER_S injects (--stall-after s after its block pool; named `gil_cycle`). onset = the
   client's last token; verdict = the verdict event's time. Reported: median and max of onset -> verdict,
   and what is left after the window.

`--long`: instead, the same server healthy under load for --long-s seconds and then idle for --long-s
seconds with the watch beside it: the number of stalls it reports (must be 0).

`--probe-load`: instead, the probe's load on an idle server (`kvdiag watch --probe`): --probe-load-s seconds with a
passive watch beside it, then as long with a probing watch (--probe-period); the difference in the EngineCore's and
the API server's CPU over the probes sent is each probe's cost; the probes per minute, their latency, the stalls
reported (must be 0).

Run it alone: `flock /tmp/kvdiag-bench.lock flock /tmp/kvdiag-vllm.lock python benchmarks/watch.py`.
Ends with `RESULT overhead=... noise=... onset_to_verdict_median_s=... onset_to_verdict_max_s=... window_s=...`.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from steadyload import SteadyLoad, served_model, wait_engine_busy  # noqa: E402
from vllmserver import VllmServer  # noqa: E402
from watchproc import WatchProc  # noqa: E402

from kvdiag.osread.stat import read_stat  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK") or 100


def _cpu_s(pid: int) -> float | None:
    st = read_stat(pid)
    return None if st is None else (st.utime + st.stime) / CLK


def _measure(load: SteadyLoad, seconds: float) -> float:
    t0, k0 = time.monotonic(), load.tokens
    time.sleep(seconds)
    return (load.tokens - k0) / (time.monotonic() - t0)


def _start_watch(server: VllmServer, out: Path, *extra: str) -> WatchProc:
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    w = WatchProc("--url", server.url, "--out", str(out), *extra, env=env).start()
    if w.wait_event("start", 60) is None:
        raise SystemExit("watch did not start:\n" + w.diag())
    return w


def _tree_cpu_s(pids: list[int]) -> float:
    return sum(c for c in (_cpu_s(p) for p in pids) if c is not None)


def scrape_cost_ms(server: VllmServer, looks: int = 100) -> tuple[float, float]:
    """The API server's CPU (ms) per GET /metrics and per GET /health, on the idle server."""
    out = []
    with httpx.Client(trust_env=False, timeout=10) as client:
        for path in ("/metrics", "/health"):
            c0 = _cpu_s(server.pid) or 0.0
            for _ in range(looks):
                client.get(server.url + path)
            out.append(((_cpu_s(server.pid) or 0.0) - c0) / looks * 1000)
    return out[0], out[1]


def paired_overhead(without: list[float], with_: list[float], seed: int = 7) -> tuple[float, float, float]:
    """1 - median(with_i / without_i) over the pairs, and its bootstrap 95 % interval (low, high)."""
    ratios = [w / o for w, o in zip(with_, without, strict=True) if o > 0]
    if not ratios:
        return 0.0, 0.0, 0.0
    rng = random.Random(seed)
    boots = sorted(1 - statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(4000))
    return 1 - statistics.median(ratios), boots[int(0.025 * len(boots))], boots[int(0.975 * len(boots)) - 1]


def overhead(server: VllmServer, load: SteadyLoad, out: Path, pairs: int, round_s: float,
             period_s: float = 1.0) -> dict[str, Any]:
    """Alternating rounds on one watch process (one look every ``period_s``): running in the rounds with,
    SIGSTOPped (kvdiag's own process, not the server) in the rounds without, so no round pays for its start-up."""
    without: list[float] = []
    with_: list[float] = []
    cpu: list[float] = []
    per_token: dict[bool, list[float]] = {False: [], True: []}
    w = _start_watch(server, out / f"overhead-{period_s:g}", "--period", f"{period_s:g}")
    assert w.popen is not None
    pid = w.popen.pid
    tree = server.tree()
    try:
        time.sleep(2.0)          # its start-up (imports, discovery) is not the steady cost
        for i in range(pairs):
            for watched in ((False, True) if i % 2 == 0 else (True, False)):
                os.kill(pid, signal.SIGCONT if watched else signal.SIGSTOP)
                time.sleep(0.3)
                c0, s0, k0, t0 = _cpu_s(pid), _tree_cpu_s(tree), load.tokens, time.monotonic()
                rate = _measure(load, round_s)
                c1, s1, k1, t1 = _cpu_s(pid), _tree_cpu_s(tree), load.tokens, time.monotonic()
                if k1 > k0:
                    per_token[watched].append((s1 - s0) / (k1 - k0) * 1000)
                if watched:
                    with_.append(rate)
                    if c0 is not None and c1 is not None:
                        cpu.append((c1 - c0) / (t1 - t0))
                    print(f"  pair {i + 1} with watch:    {rate:8.0f} tok/s (watch CPU {cpu[-1] * 100:.2f} %)",
                          flush=True)
                else:
                    without.append(rate)
                    print(f"  pair {i + 1} without watch: {rate:8.0f} tok/s", flush=True)
        os.kill(pid, signal.SIGCONT)
        stalls_seen = len(w.named("stall"))
        w.terminate()
        w.wait(20)
    finally:
        if w.popen.poll() is None:
            os.kill(pid, signal.SIGCONT)
        w.kill()
    base = statistics.median(without)
    noise = statistics.pstdev(without) / base if base and len(without) > 1 else 0.0
    paired, low, high = paired_overhead(without, with_)
    return {"without": without, "with": with_, "overhead": paired, "ci": (low, high),
            "overhead_medians": 1 - statistics.median(with_) / base if base else 0.0,
            "noise": noise, "watch_cpu": statistics.median(cpu) if cpu else None, "stalls": stalls_seen,
            "server_ms_per_token": {k: statistics.median(v) if v else None for k, v in per_token.items()}}


def sigstops(server: VllmServer, load: SteadyLoad, out: Path, stops: int, window_s: float) -> list[dict[str, Any]]:
    """One watch left running (cooldown 0) while the EngineCore is SIGSTOPped and SIGCONTed ``stops`` times."""
    core = server.engine_core_pid()
    assert core is not None
    w = _start_watch(server, out / "stops", "--window", f"{window_s:g}", "--period", "0.5", "--cooldown", "0")
    rows: list[dict[str, Any]] = []
    try:
        for k in range(stops):
            time.sleep(2.0)
            wait_engine_busy(server.url)     # a stall under load: the EngineCore has requests when it stops
            os.kill(core, signal.SIGSTOP)
            try:
                v = w.wait_event("verdict", 20 + window_s)
            finally:
                os.kill(core, signal.SIGCONT)
            if v is None or load.last_token_wall is None:
                # It stopped right after an idle step: its gauges say 0 in flight, as for a user (docs/watch.md).
                print(f"  SIGSTOP {k + 1}: not named (the EngineCore's last gauges showed no request)", flush=True)
                continue
            rows.append({"stall": f"SIGSTOP {k + 1}", "kind": v["kind"], "s": v["unix"] - load.last_token_wall})
            print(f"  SIGSTOP {k + 1}: {v['kind']:8s} {rows[-1]['s']:.2f} s after the last token", flush=True)
            if w.wait_event("recovered", 30) is None:
                raise SystemExit("no recovery after SIGCONT:\n" + w.diag())
        w.terminate()
        w.wait(20)
    finally:
        w.kill()
    return rows


def injected(server: VllmServer, load: SteadyLoad, out: Path, window_s: float, stall_after_s: float,
             ready: float) -> dict[str, Any] | None:
    """A --once watch while the EngineCore falls into the GIL cycle ``stall_after_s`` after its block pool."""
    w = _start_watch(server, out / "gil", "--once", "--window", f"{window_s:g}", "--period", "0.5")
    try:
        rc = w.wait(max(0.0, stall_after_s - (time.monotonic() - ready)) + 60)
        last = load.last_token_wall
    finally:
        w.kill()
    if rc != 10 or last is None or not w.named("verdict"):
        print("  injected: not named\n" + w.diag(), flush=True)
        return None
    (v,), (st,) = w.named("verdict"), w.named("stall")
    row = {"stall": "injected GIL cycle", "kind": v["kind"], "s": v["unix"] - last, "health": st.get("health")}
    print(f"  injected: {v['kind']:8s} {row['s']:.2f} s after the last token, /health {row['health']}", flush=True)
    return row


def long_run(server: VllmServer, out: Path, long_s: float, window_s: float) -> dict[str, Any]:
    w = _start_watch(server, out / "long", "--window", f"{window_s:g}")
    try:
        with SteadyLoad(server.url, served_model(server.url), streams=4, max_tokens=120) as load:
            time.sleep(long_s)
            loaded_tokens = load.tokens
        busy_stalls = len(w.named("stall"))
        time.sleep(long_s)
        w.terminate()
        rc = w.wait(30)
    finally:
        w.kill()
    return {"tokens": loaded_tokens, "busy_stalls": busy_stalls, "stalls": len(w.named("stall")),
            "errors": len(w.named("error")), "rc": rc}


def probe_load(server: VllmServer, out: Path, seconds: float, probe_period_s: float) -> dict[str, Any]:
    """The idle server's CPU with a passive watch, then with a probing one, for ``seconds`` each."""
    core = server.engine_core_pid()
    if core is None:
        raise SystemExit("no EngineCore")
    cpu: dict[bool, tuple[float, float]] = {}
    watches: dict[bool, WatchProc] = {}
    for probing in (False, True):
        extra = ("--probe", "--probe-period", f"{probe_period_s:g}") if probing else ()
        w = _start_watch(server, out / f"probe-{probing}", *extra)
        try:
            c0, s0 = _cpu_s(core) or 0.0, _cpu_s(server.pid) or 0.0
            time.sleep(seconds)
            cpu[probing] = ((_cpu_s(core) or 0.0) - c0, (_cpu_s(server.pid) or 0.0) - s0)
            w.terminate()
            w.wait(30)
        finally:
            w.kill()
        watches[probing] = w
    w = watches[True]
    sent, answered = len(w.named("probe")), w.named("probe_answered")
    lat = sorted(a["latency_s"] for a in answered)
    n = max(1, len(answered))
    return {"sent": sent, "answered": len(answered), "failed": len(w.named("probe_failed")),
            "stalls": len(w.named("stall")) + len(watches[False].named("stall")),
            "per_min": sent / (seconds / 60.0), "latency_median_s": statistics.median(lat) if lat else None,
            "latency_max_s": lat[-1] if lat else None,
            "core_ms_per_probe": (cpu[True][0] - cpu[False][0]) / n * 1000,
            "server_ms_per_probe": (cpu[True][1] - cpu[False][1]) / n * 1000,
            "core_idle_pct": cpu[False][0] / seconds * 100, "core_probing_pct": cpu[True][0] / seconds * 100}


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-bench-watch-"))
    try:
        return run(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(tmp: Path) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=10, help="alternating without/with rounds")
    ap.add_argument("--round-s", type=float, default=5.0)
    ap.add_argument("--amplify", type=lambda t: [float(x) for x in t.split(",") if x], default=[0.1],
                    help="watch periods (s) for the amplified rounds; '' for none")
    ap.add_argument("--amp-pairs", type=int, default=20)
    ap.add_argument("--stall-after", type=float, default=60.0,
                    help="KVDIAG_VLLM_STALL_AFTER_S of the stall server (raised to leave the SIGSTOP rounds time)")
    ap.add_argument("--step-delay-ms", type=float, default=40.0, help="the stall server's extra step time")
    ap.add_argument("--stops", type=int, default=3, help="SIGSTOP stalls before the injected one")
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--long", action="store_true", help="10 minutes healthy under load, 10 idle: stalls reported")
    ap.add_argument("--long-s", type=float, default=600.0)
    ap.add_argument("--probe-load", action="store_true", help="the --probe canary's load on an idle server")
    ap.add_argument("--probe-load-s", type=float, default=600.0, help="seconds per phase (passive, probing)")
    ap.add_argument("--probe-period", type=float, default=30.0)
    args = ap.parse_args()
    load_avg = os.getloadavg()[0]
    if args.probe_load:
        server = VllmServer(tmp / "vllm.log")
        try:
            server.start()
            if not server.wait_ready(240):
                raise SystemExit(server.log_text()[-3000:])
            time.sleep(3.0)
            r = probe_load(server, tmp, args.probe_load_s, args.probe_period)
        finally:
            server.stop()
        print(f"\n| measure (idle server, {args.probe_load_s:g} s per phase, --probe-period {args.probe_period:g}) "
              f"| value |\n|---|---|")
        print(f"| probes sent / answered / failed | {r['sent']} / {r['answered']} / {r['failed']} |")
        print(f"| probes per minute | {r['per_min']:.2f} |")
        print(f"| probe latency, median / max | {r['latency_median_s']} / {r['latency_max_s']} s |")
        print(f"| EngineCore CPU per probe (probing minus passive) | {r['core_ms_per_probe']:.1f} ms |")
        print(f"| API server CPU per probe (probing minus passive) | {r['server_ms_per_probe']:.1f} ms |")
        print(f"| EngineCore CPU, passive / probing | {r['core_idle_pct']:.2f} / {r['core_probing_pct']:.2f} % of a "
              "core |")
        print(f"| stalls reported | {r['stalls']} |")
        print(f"load average at start {load_avg:.1f}, {os.cpu_count()} CPUs")
        print(f"RESULT probe_stalls={r['stalls']} probes_per_min={r['per_min']:.2f} "
              f"core_ms_per_probe={r['core_ms_per_probe']:.1f} server_ms_per_probe={r['server_ms_per_probe']:.1f} "
              f"probe_load_s={args.probe_load_s:g} probe_period_s={args.probe_period:g}")
        return 0
    if args.long:
        server = VllmServer(tmp / "vllm.log", max_num_seqs=1)
        try:
            server.start()
            if not server.wait_ready(240):
                raise SystemExit(server.log_text()[-3000:])
            r = long_run(server, tmp, args.long_s, args.window)
        finally:
            server.stop()
        print(f"\n| phase | seconds | stalls reported |\n|---|---|---|\n| under load ({r['tokens']} tokens) | "
              f"{args.long_s:g} | {r['busy_stalls']} |\n| idle | {args.long_s:g} | {r['stalls'] - r['busy_stalls']} |")
        print(f"scrape errors {r['errors']}, watch exit {r['rc']}, load average at start {load_avg:.1f}")
        print(f"RESULT long_stalls={r['stalls']} long_s={args.long_s:g} window_s={args.window:g}")
        return 0
    server = VllmServer(tmp / "vllm.log", max_num_seqs=1)
    try:
        server.start()
        if not server.wait_ready(240):
            raise SystemExit(server.log_text()[-3000:])
        time.sleep(3.0)
        metrics_ms, health_ms = scrape_cost_ms(server)
        print(f"the API server's CPU per look (idle): /metrics {metrics_ms:.2f} ms, /health {health_ms:.2f} ms",
              flush=True)
        with SteadyLoad(server.url, served_model(server.url), streams=4, max_tokens=120, read_timeout_s=60) as load:
            time.sleep(3.0)
            print("overhead rounds:", flush=True)
            ov = overhead(server, load, tmp, args.pairs, args.round_s)
            amp: list[tuple[float, dict[str, Any]]] = []
            for period in args.amplify:
                print(f"overhead rounds, one look every {period:g} s ({1 / period:g}x the default):", flush=True)
                amp.append((period, overhead(server, load, tmp, args.amp_pairs, args.round_s, period_s=period)))
    finally:
        server.stop()
    # The stalls: a real model's step time (requests queue in the EngineCore, so its last gauges show them).
    stall_after = max(args.stall_after, 25.0 + args.stops * (args.window + 12.0))
    server = VllmServer(tmp / "vllm-stall.log", max_num_seqs=1, stall_after_s=stall_after,
                        step_delay_ms=args.step_delay_ms)
    rows: list[dict[str, Any]] = []
    try:
        server.start()
        if not server.wait_ready(240):
            raise SystemExit(server.log_text()[-3000:])
        ready = time.monotonic()
        with SteadyLoad(server.url, served_model(server.url), streams=4, max_tokens=120, read_timeout_s=60) as load:
            time.sleep(3.0)
            print(f"stalls (EngineCore steps +{args.step_delay_ms:g} ms, injected stall at {stall_after:g} s):",
                  flush=True)
            rows = sigstops(server, load, tmp, args.stops, args.window)
            if time.monotonic() - ready < stall_after - 5:
                gil = injected(server, load, tmp, args.window, stall_after, ready)
                if gil is not None:
                    rows.append(gil)
            else:
                print("  injected: skipped (the SIGSTOP rounds ran past the injected stall's time)", flush=True)
    finally:
        server.stop()
    if not rows:
        raise SystemExit("no stall was named")
    after = [r["s"] for r in rows]
    med, mx = statistics.median(after), max(after)
    print("\n| measure | value |\n|---|---|")
    print(f"| tokens/s without watch (median of {len(ov['without'])}) | {statistics.median(ov['without']):.0f} |")
    print(f"| tokens/s with watch (median of {len(ov['with'])}) | {statistics.median(ov['with']):.0f} |")
    lo, hi = ov["ci"]
    print(f"| throughput overhead (median of the pairs' ratios) | {ov['overhead'] * 100:+.2f} % "
          f"(95 % interval {lo * 100:+.2f} .. {hi * 100:+.2f} %) |")
    print(f"| throughput overhead (ratio of the medians) | {ov['overhead_medians'] * 100:+.2f} % |")
    scaled: list[float] = []
    for period, a in amp:
        alo, ahi = a["ci"]
        scaled.append(a["overhead"] * period)
        print(f"| overhead, one look every {period:g} s (median of pairs, 95 % interval) | "
              f"{a['overhead'] * 100:+.2f} % "
              f"({alo * 100:+.2f} .. {ahi * 100:+.2f} %); watch CPU {(a['watch_cpu'] or 0) * 100:.1f} % of a core |")
        print(f"| ... scaled to one look a second (x {period:g}) | {a['overhead'] * period * 100:+.3f} % "
              f"({alo * period * 100:+.3f} .. {ahi * period * 100:+.3f} %) |")
    look_ms = metrics_ms + health_ms
    watch_core = ov["watch_cpu"] or 0.0
    print(f"| the API server's CPU per look (GET /metrics + /health, idle server) | {metrics_ms:.2f} + "
          f"{health_ms:.2f} ms = {look_ms / 10:.2f} % of a core at one look a second |")
    print(f"| accounting: watch + the server's part, at one look a second | {watch_core * 100:.2f} + "
          f"{look_ms / 10:.2f} % of a core = {(watch_core * 100 + look_ms / 10) / (os.cpu_count() or 1):.2f} % "
          f"of this {os.cpu_count()}-CPU machine |")
    spt = ov["server_ms_per_token"]
    if spt[False] is not None and spt[True] is not None:
        print(f"| server CPU per token without / with watch | {spt[False]:.3f} / {spt[True]:.3f} ms "
              f"({(spt[True] / spt[False] - 1) * 100:+.2f} %) |")
    print(f"| noise (std of the rounds without / their median) | {ov['noise'] * 100:.2f} % |")
    print(f"| stalls reported during the overhead rounds | {ov['stalls']} |")
    if ov["watch_cpu"] is not None:
        print(f"| watch's own CPU | {ov['watch_cpu'] * 100:.2f} % of a core |")
    for r in rows:
        print(f"| {r['stall']} -> {r['kind']} | {r['s']:.2f} s after the last token ({r['s'] - args.window:+.2f} s "
              "over the window) |")
    print(f"| onset -> verdict, median / max | {med:.2f} / {mx:.2f} s (window {args.window:g} s) |")
    print(f"load average at start {load_avg:.1f}, {os.cpu_count()} CPUs")
    kinds = ",".join(sorted({r["kind"] for r in rows}))
    amp_txt = "".join(f"overhead_at_{p:g}s={a['overhead']:.4f} " for p, a in amp)
    per_look = f"overhead_per_look_scaled={max(scaled):.4f} " if scaled else ""
    print(f"RESULT {per_look}{amp_txt}look_cpu_ms={look_ms:.2f} overhead={ov['overhead']:.4f} "
          f"overhead_ci95={lo:.4f}..{hi:.4f} "
          f"noise={ov['noise']:.4f} "
          f"watch_cpu={(ov['watch_cpu'] or 0):.4f} onset_to_verdict_median_s={med:.2f} "
          f"onset_to_verdict_max_s={mx:.2f} window_s={args.window:g} after_window_max_s={mx - args.window:.2f} "
          f"stalls={len(rows)} kinds={kinds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
