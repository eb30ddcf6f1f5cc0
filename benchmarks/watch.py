"""Benchmark: what `kvdiag watch` costs a real vLLM CPU server, and how fast it names a stall.

One real `vllm serve` (vLLM CPU, the tiny model, kvdiag's plugin with the fixed allocator; started by this
script, not by kvdiag) under a steady streaming load (4 streams of 120-147 tokens, --max-num-seqs 1):

1. overhead: alternating rounds of the same load with one `kvdiag watch --url` beside it (its default 1 s
   period) running, and SIGSTOPped (kvdiag's own process) in the rounds without; tokens/s counted by the
   client in each round, the order alternating per pair. overhead = 1 - median(with) / median(without); the
   noise is the rounds without's standard deviation over their median. The watch's own CPU is read from /proc.
2. stall onset -> verdict: a watch left running (window --window, cooldown 0) while the EngineCore is
   SIGSTOPped --stops times (each named `stopped`, then SIGCONT: the server recovers); then a fresh server
   whose EngineCore falls into the GIL cycle KVDIAG_VLLM_STALL_AFTER_S injects (--stall-after s into
   serving), watched with --once (named `gil_cycle`). onset = the client's last token; verdict = the verdict
   event's time. Reported: median and max of onset -> verdict, and what is left after the window.

`--long`: instead, the same server healthy under load for --long-s seconds and then idle for --long-s
seconds with the watch beside it: the number of stalls it reports (must be 0).

Run it alone: `flock /tmp/kvdiag-bench.lock flock /tmp/kvdiag-vllm.lock python benchmarks/watch.py`.
Ends with `RESULT overhead=... noise=... onset_to_verdict_median_s=... onset_to_verdict_max_s=... window_s=...`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def overhead(server: VllmServer, load: SteadyLoad, out: Path, pairs: int, round_s: float) -> dict[str, Any]:
    """Alternating rounds on one watch process: running in the rounds with, SIGSTOPped (kvdiag's own process,
    not the server) in the rounds without, so no round pays for its start-up."""
    without: list[float] = []
    with_: list[float] = []
    cpu: list[float] = []
    w = _start_watch(server, out / "overhead")
    assert w.popen is not None
    pid = w.popen.pid
    try:
        time.sleep(2.0)          # its start-up (imports, discovery) is not the steady cost
        for i in range(pairs):
            for watched in ((False, True) if i % 2 == 0 else (True, False)):
                os.kill(pid, signal.SIGCONT if watched else signal.SIGSTOP)
                time.sleep(0.3)
                c0, t0 = _cpu_s(pid), time.monotonic()
                rate = _measure(load, round_s)
                c1, t1 = _cpu_s(pid), time.monotonic()
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
    return {"without": without, "with": with_, "overhead": 1 - statistics.median(with_) / base if base else 0.0,
            "noise": noise, "watch_cpu": statistics.median(cpu) if cpu else None, "stalls": stalls_seen}


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


def injected(tmp: Path, window_s: float, stall_after_s: float) -> dict[str, Any] | None:
    """A fresh server whose EngineCore falls into the GIL cycle ``stall_after_s`` into serving, watched from
    its start (--once)."""
    server = VllmServer(tmp / "vllm-gil.log", stall_after_s=stall_after_s, max_num_seqs=1)
    try:
        server.start()
        if not server.wait_ready(240):
            raise SystemExit(server.log_text()[-3000:])
        # The watch first: the stall comes stall_after_s after the engine is ready, load or not.
        w = _start_watch(server, tmp / "gil", "--once", "--window", f"{window_s:g}", "--period", "0.5")
        try:
            with SteadyLoad(server.url, served_model(server.url), streams=4, max_tokens=120,
                            read_timeout_s=60) as load:
                rc = w.wait(stall_after_s + 45)
                last = load.last_token_wall
        finally:
            w.kill()
        if rc != 10 or last is None or not w.named("verdict"):
            # The EngineCore froze right after an idle step: its gauges say 0 in flight (docs/watch.md).
            print("  injected: not named (the EngineCore's last gauges showed no request in flight)")
            return None
        (v,), (st,) = w.named("verdict"), w.named("stall")
        row = {"stall": "injected GIL cycle", "kind": v["kind"], "s": v["unix"] - last, "health": st.get("health")}
        print(f"  injected: {v['kind']:8s} {row['s']:.2f} s after the last token, /health {row['health']}", flush=True)
        return row
    finally:
        server.stop()


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
    ap.add_argument("--stall-after", type=float, default=25.0, help="KVDIAG_VLLM_STALL_AFTER_S of the last server")
    ap.add_argument("--stops", type=int, default=3, help="SIGSTOP stalls before the injected one")
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--long", action="store_true", help="10 minutes healthy under load, 10 idle: stalls reported")
    ap.add_argument("--long-s", type=float, default=600.0)
    args = ap.parse_args()
    load_avg = os.getloadavg()[0]
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
        with SteadyLoad(server.url, served_model(server.url), streams=4, max_tokens=120, read_timeout_s=60) as load:
            time.sleep(3.0)
            print("overhead rounds:", flush=True)
            ov = overhead(server, load, tmp, args.pairs, args.round_s)
            print("stalls:", flush=True)
            rows = sigstops(server, load, tmp, args.stops, args.window)
    finally:
        server.stop()
    gil = injected(tmp, args.window, args.stall_after)
    if gil is not None:
        rows.append(gil)
    after = [r["s"] for r in rows]
    med, mx = statistics.median(after), max(after)
    print("\n| measure | value |\n|---|---|")
    print(f"| tokens/s without watch (median of {len(ov['without'])}) | {statistics.median(ov['without']):.0f} |")
    print(f"| tokens/s with watch (median of {len(ov['with'])}) | {statistics.median(ov['with']):.0f} |")
    print(f"| throughput overhead | {ov['overhead'] * 100:+.2f} % |")
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
    print(f"RESULT overhead={ov['overhead']:.4f} noise={ov['noise']:.4f} "
          f"watch_cpu={(ov['watch_cpu'] or 0):.4f} onset_to_verdict_median_s={med:.2f} "
          f"onset_to_verdict_max_s={mx:.2f} window_s={args.window:g} after_window_max_s={mx - args.window:.2f} "
          f"stalls={len(rows)} kinds={kinds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
