"""Fixed vs stock page allocator: fast path, contention, stalls, and the engine-2 repro.

Run from the repo root after the install (a regular ``pip install .`` is what users get):

    python benchmarks/allocator.py [--quick] [--rounds N] [--native-rounds N] [--load quiet|spin|both]
                                   [--out FILE]

Run as a script (not ``python -m``), sys.path[0] is benchmarks/, so kvdiag and kvdiag._native come
from the installed package, not from the checkout in the current directory; the header prints
where they came from, whether the install is editable, and the build type and flags of the
stock and fixed code (the run stops if they differ: both must be measured at the same
optimization level).

Every row runs alternating rounds (stock first in even rounds, fixed first in odd ones): --rounds
for the Python rows, --native-rounds (more, shorter) for the two native rows, whose outcome
depends most on how the host schedules 8 threads on its cores. Each round gives one fixed/stock
ratio; the row reports the median ratio, its spread (min..max over the rounds) and how many
rounds fell below 1.0x. The header prints the host facts that decide the native rows (cores and
affinity, kernel, CPU model, hypervisor, frequency governor when readable, load average).
--load spin runs the table with three busy-looping processes competing for the same CPUs
(started and killed by this script, each bounded in time); --load both runs it quiet, then
under that load. Rows (stock is the baseline, measured in the same run):
  single_ratio     alloc_page+free_page pairs per second, one Python thread calling the bindings
                   (what the engine's scheduler thread does).
  contended_ratio  the same pairs from 8 Python threads sharing one allocator.
  native_pairs_ratio   8 NATIVE threads (kvdiag._native.stress, C++ threads, no GIL), alloc+free
                   pairs: both allocators serialise on one mutex, so this is the cost of the lock
                   and the list work per op.
  native_random_ratio  8 native threads, randomized alloc/free/free_pages/trigger/resize/trim.
  burst_ratio      8 Python threads allocating bursts of 16 pages with 100 us maps (slow path:
                   the reserve runs dry, so most pages are mapped synchronously). Fixed releases
                   the GIL around each map and combines concurrent callers' maps into one
                   backend call; stock keeps the GIL through its maps (which is what deadlocks it).
  stalls           operations slower than --stall-ms (default 250 ms, 2.5x the fixed allocator's
                   100 ms wait slice) or raising AllocatorTimeout, over 10^7 randomized
                   alloc/free/free_pages/trigger/resize/trim operations on the fixed allocator
                   (native driver loop, 4 threads, an over-subscribed pool).
  stock_hangs / fixed_hangs  tests/fixtures/alloc_engine2.py (the seed's engine 2, prealloc on)
                   run 20 times each; a run "hangs" if alloc_page has not returned 3 s after the
                   fixture's READY line (a healthy start takes ~0.2 s); hung runs are killed.
The cpu/op column is stock's CPU seconds per pair/op/page over fixed's (the whole process, all
threads, median over the rounds): what each allocator costs, whatever share of these shared CPUs
the scheduler gave the run. The csw/kop column gives the context switches (voluntary +
involuntary, whole process) per 1,000 units, stock|fixed, median over the rounds: a thread that
parks on a contended lock switches, a spinning one does not. The slow-path rows also print the
allocators' own counts per 1,000 pages or ops (map calls, pages per map, worker wake-ups, combined maps).
Ends with one line per load: RESULT load=quiet|spin single_ratio=... contended_ratio=... stalls=...
native_pairs_ratio=... native_random_ratio=... burst_ratio=... min_ratio=... rounds_below_1=N
stock_hangs=N/20 fixed_hangs=N/20 build=...
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "alloc_engine2.py"
PAGE = 64 * 1024
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def _dev(tag: str) -> str:
    return f"kvdiag-bench-{os.getpid()}-{tag}-{time.monotonic_ns()}"


def _make(native: Any, kind: str, **kw: Any) -> Any:
    cls = native.StockPageAllocator if kind == "stock" else native.FixedPageAllocator
    args: dict[str, Any] = dict(device_name=_dev(kind), print_banner=False, min_reserved_pages=5,
                                max_reserved_pages=10)
    args.update(kw)
    return cls(4, 256 * PAGE, PAGE, **args)


Sample = tuple[float, dict[str, int]]  # (rate per second, the allocator's counters)


def single_thread(native: Any, kind: str, seconds: float) -> Sample:
    """alloc_page + free_page pairs per second from one Python thread (prealloc on, reserve warm)."""
    a = _make(native, kind)
    a.start_prealloc_thread()
    a.wait_prealloc_idle(10.0)
    alloc, free = a.alloc_page, a.free_page
    pairs = 0
    t0 = time.perf_counter()
    stop = t0 + seconds
    # Time-based like the other rows: long enough to span many scheduler slices on a shared
    # machine; the clock is read once per 1,000 pairs.
    while time.perf_counter() < stop:
        for _ in range(1000):
            free(alloc())
        pairs += 1000
    dt = time.perf_counter() - t0
    a.stop_prealloc_thread()
    c = a.counters()
    c["units"] = pairs
    return pairs / dt, c


def native_contended(native: Any, kind: str, ops: int, mode: str = "alloc_free") -> Sample:
    """Pairs (alloc_free) or operations (random) per second from 8 native threads."""
    r = native.stress(kind=kind, threads=8, ops=ops, mode=mode, num_layers=4, mem_size_per_layer=256 * PAGE,
                      page_size=PAGE, min_reserved_pages=5, max_reserved_pages=10, device_name=_dev(kind))
    if r["errors"] or r["double_allocs"]:
        raise SystemExit(f"{kind} stress failed: {r}")
    c = r["counters"]
    c["units"] = r["ops"]
    return float(r["ops"]) / (r["elapsed_ns"] / 1e9), c


def python_contended(native: Any, kind: str, seconds: float, burst: int = 1, latency_us: int = 0) -> Sample:
    """Pages allocated+freed per second by 8 Python threads calling the bindings."""
    a = _make(native, kind, map_latency_us=latency_us)
    a.start_prealloc_thread()
    a.wait_prealloc_idle(10.0)
    stop = time.perf_counter() + seconds
    counts = [0] * 8

    def work(i: int) -> None:
        alloc, free = a.alloc_page, a.free_page
        n = 0
        # The clock is read once per 64 pairs so the harness (perf_counter, counting) costs the
        # same small share for both allocators instead of diluting the allocator's own cost.
        if burst == 1:
            while time.perf_counter() < stop:
                for _ in range(64):
                    free(alloc())
                n += 64
        else:
            while time.perf_counter() < stop:
                for _ in range(4):
                    pages = [alloc() for _ in range(burst)]
                    for p in pages:
                        free(p)
                n += 4 * burst
        counts[i] = n

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    a.stop_prealloc_thread()
    c = a.counters()
    c["units"] = sum(counts)
    return sum(counts) / dt, c


class Row:
    """One benchmark row: alternating rounds, one fixed/stock ratio per round."""

    def __init__(self, key: str, name: str) -> None:
        self.key, self.name = key, name
        self.stock: list[float] = []
        self.fixed: list[float] = []
        self.ratios: list[float] = []
        self.cpu_ratios: list[float] = []  # stock / fixed CPU seconds per unit
        self.counters: dict[str, list[dict[str, int]]] = {"stock": [], "fixed": []}
        self.csw: dict[str, list[float]] = {"stock": [], "fixed": []}  # context switches per 1,000 units

    def run(self, fn: Callable[[str], Sample], n: int) -> None:
        for i in range(n):
            got: dict[str, Sample] = {}
            cpu: dict[str, float] = {}
            csw: dict[str, float] = {}
            for kind in (("stock", "fixed") if i % 2 == 0 else ("fixed", "stock")):
                c0, s0 = _cpu_s(), _switches()
                got[kind] = fn(kind)
                units = max(1, got[kind][1]["units"])
                cpu[kind] = (_cpu_s() - c0) / units
                csw[kind] = (_switches() - s0) * 1000.0 / units
            self.stock.append(got["stock"][0])
            self.fixed.append(got["fixed"][0])
            self.ratios.append(got["fixed"][0] / got["stock"][0])
            if cpu["fixed"] > 0:
                self.cpu_ratios.append(cpu["stock"] / cpu["fixed"])
            self.csw["stock"].append(csw["stock"])
            self.csw["fixed"].append(csw["fixed"])
            self.counters["stock"].append(got["stock"][1])
            self.counters["fixed"].append(got["fixed"][1])

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def below_one(self) -> int:
        return sum(1 for r in self.ratios if r < 1.0)

    def line(self) -> str:
        spread = f"{min(self.ratios):.2f}..{max(self.ratios):.2f}"
        cpu = f"{statistics.median(self.cpu_ratios):.2f}x" if self.cpu_ratios else "-"
        csw = f"{statistics.median(self.csw['stock']):.1f}|{statistics.median(self.csw['fixed']):.1f}"
        below = f"{self.below_one}/{len(self.ratios)}"
        return (f"{self.name:<44}{statistics.median(self.stock):>12,.0f}/s{statistics.median(self.fixed):>12,.0f}/s"
                f"{self.ratio:>12.2f}x  {spread:<11}{below:>6}{cpu:>8}  {csw}")

    def counts(self) -> str:
        """The allocators' own counts per 1,000 units (pages or ops), summed over the rounds."""
        out = []
        for kind in ("stock", "fixed"):
            cs = self.counters[kind]
            total = {k: sum(int(c.get(k, 0)) for c in cs) for k in
                     ("map_calls", "pages_mapped", "unmap_calls", "worker_wakeups", "combined_maps", "units")}
            n = total["units"]
            per = 1000.0 / max(1, n)
            batch = total["pages_mapped"] / max(1, total["map_calls"])
            out.append(f"{kind}: {total['map_calls'] * per:.1f} maps ({batch:.1f} pages each), "
                       f"{total['unmap_calls'] * per:.1f} unmaps, {total['worker_wakeups'] * per:.1f} worker wake-ups, "
                       f"{total['combined_maps'] * per:.1f} combined maps")
        return "    per 1,000: " + "; ".join(out)


def _switches() -> int:
    """Context switches of this process so far, all threads (voluntary + involuntary)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw


def host_facts() -> list[str]:
    """What decides the native rows: cores this process may use, kernel, CPU, hypervisor, governor."""
    model, hypervisor = "?", False
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and " hypervisor" in line:
                hypervisor = True
    except OSError:
        pass
    gov_path = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    try:
        governor = gov_path.read_text().strip()
    except OSError:
        governor = "not readable (no cpufreq in this kernel or VM)"
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [f"host: {os.cpu_count()} CPUs online, {affinity} usable by this process; kernel {platform.release()}; "
            f"{'virtual machine (hypervisor flag)' if hypervisor else 'no hypervisor flag'}",
            f"cpu: {model}; frequency governor: {governor}"]


SPIN = "import time\nend = time.monotonic() + {bound}\nwhile time.monotonic() < end:\n    pass\n"


class Spinners:
    """`n` busy-looping processes competing for the CPUs, each bounded to `bound_s`, killed on exit."""

    def __init__(self, n: int, bound_s: float) -> None:
        self.n, self.bound_s = n, bound_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Spinners:
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", SPIN.format(bound=self.bound_s)],
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)
        self.procs.clear()


def _cpu_s() -> float:
    """CPU seconds used by this process so far, all threads (user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def install_info(native: Any) -> tuple[str, str]:
    """(where kvdiag and kvdiag._native were imported from, the build type shared by stock and fixed)."""
    import kvdiag

    pkg = Path(kvdiag.__file__).resolve().parent
    so = Path(native.__file__).resolve()
    # A regular install puts the package in site-packages; an editable one (or running with the
    # checkout on sys.path) imports the repository's kvdiag/.
    editable = pkg == ROOT / "kvdiag"
    kind = "EDITABLE install or the checkout (kvdiag from the repository)" if editable else "regular install"
    info = native.build_info()
    if info["stock"] != info["fixed"]:
        raise SystemExit(f"stock and fixed were compiled differently, a ratio would compare builds:\n"
                         f"  stock: {info['stock']}\n  fixed: {info['fixed']}")
    def short(path: Path) -> str:
        """The path from the checkout or from site-packages: a results file names no machine's folders."""
        if path.is_relative_to(ROOT):
            return str(path.relative_to(ROOT))
        parts = path.parts
        return str(Path(*parts[parts.index("site-packages"):])) if "site-packages" in parts else path.name

    where = f"{kind}: kvdiag from {short(pkg)}, _native from {short(so)}"
    return where, info["fixed"]


def engine2_once(native: Any, kind: str, hang_after_s: float) -> tuple[bool, float]:
    """Run the engine-2 fixture once; (hung, seconds from READY to started or to the verdict)."""
    proc = subprocess.Popen([sys.executable, str(FIXTURE), "--allocator", kind, "--prealloc", "on",
                             "--alarm-s", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT)
    lines: list[str] = []
    ready = threading.Event()
    started = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("KVDIAG_E2 READY"):
                ready.set()
            if line.startswith("KVDIAG_E2 STARTED"):
                started.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        if not ready.wait(60):
            raise SystemExit(f"engine2 {kind}: no READY line: {''.join(lines)[-2000:]}")
        t0 = time.monotonic()
        ok = started.wait(hang_after_s)
        return (not ok, time.monotonic() - t0)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        reader.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        native.remove_stale_device_files(f"kvdiag-e2-{proc.pid}")


def engine2_runs(native: Any, kind: str, runs: int, hang_after_s: float) -> tuple[int, list[float]]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: engine2_once(native, kind, hang_after_s), range(runs)))
    return sum(1 for hung, _ in results if hung), [s for hung, s in results if not hung]


def run_table(native: Any, args: argparse.Namespace, load: str, build_type: str) -> str:
    """One full table (every row, the stall run, the engine-2 repro) under `load`; its RESULT line."""
    q = args.quick
    n_rounds = args.rounds or (3 if q else 7)
    n_native = args.native_rounds or (5 if q else 15)
    t_start = time.monotonic()
    say(f"== load: {load}" + ("" if load == "quiet" else f" ({args.spinners} busy-looping processes on the same CPUs)")
        + f"; load average at start: {os.getloadavg()[0]:.1f} (other processes share these {os.cpu_count()} CPUs)")
    say(f"{'measure':<44}{'stock':>14}{'fixed':>14}{'fixed/stock':>13}  {'spread':<11}{'<1.0x':>6}{'cpu/op':>8}"
        f"  csw/kop s|f")

    secs = 0.4 if q else 1.0
    ops = 500_000 if q else 1_500_000
    rows: list[tuple[Row, Callable[[str], Sample], int]] = [
        (Row("single_ratio", "1 Python thread, alloc+free pairs"), lambda k: single_thread(native, k, secs), n_rounds),
        (Row("contended_ratio", "8 Python threads, alloc+free pairs"), lambda k: python_contended(native, k, secs),
         n_rounds),
        (Row("native_pairs_ratio", "8 native threads, alloc+free pairs"), lambda k: native_contended(native, k, ops),
         n_native),
        (Row("native_random_ratio", "8 native threads, randomized ops"),
         lambda k: native_contended(native, k, ops // 2, mode="random"), n_native),
        (Row("burst_ratio", "8 Py threads, bursts of 16, 100us maps"),
         lambda k: python_contended(native, k, secs, burst=16, latency_us=100), n_rounds),
    ]
    for row, fn, n in rows:
        row.run(fn, n)
        say(row.line())
        if row.key in ("native_random_ratio", "burst_ratio"):
            say(row.counts())

    total = 1_000_000 if q else 10_000_000
    t0 = time.monotonic()
    r = native.stress(kind="fixed", threads=4, ops=total, mode="random", stall_ms=args.stall_ms, hold_max=16,
                      num_layers=4, mem_size_per_layer=48 * PAGE, page_size=PAGE, min_reserved_pages=4,
                      max_reserved_pages=8, device_name=_dev("stalls"))
    stalls = int(r["stalls"]) + int(r["timeouts"])
    say("")
    say(f"fixed, {total:,} randomized ops on 4 threads ({time.monotonic() - t0:.1f} s): stalls(>{args.stall_ms} ms)="
        f"{r['stalls']} timeouts={r['timeouts']} errors={r['errors']} double_allocs={r['double_allocs']} "
        f"max_op={r['max_op_ns'] / 1e6:.1f} ms out_of_pages={r['out_of_pages']} resizes={r['resizes_ok']} "
        f"final free/total={r['final_free']}/{r['final_total']} inflight={r['final_inflight']}")
    if r["errors"] or r["double_allocs"] or r["final_free"] != r["final_total"]:
        say(f"!! inconsistent stress run: {r['first_error']}")
        stalls += 1

    runs = 5 if q else 20
    stock_hangs, _ = engine2_runs(native, "stock", runs, 3.0)
    fixed_hangs, fixed_times = engine2_runs(native, "fixed", runs, 3.0)
    say("")
    say(f"engine-2 repro, prealloc on, {runs} runs each: stock hung {stock_hangs}/{runs}; fixed hung "
        f"{fixed_hangs}/{runs}" + (f", started in median {statistics.median(fixed_times):.3f} s "
                                   f"(max {max(fixed_times):.3f} s) after READY" if fixed_times else ""))
    say(f"total {time.monotonic() - t_start:.0f} s, load average at the end: {os.getloadavg()[0]:.1f}")
    ratios = " ".join(f"{row.key}={row.ratio:.2f}" for row, _, _ in rows)
    every = [x for row, _, _ in rows for x in row.ratios]
    below = sum(row.below_one for row, _, _ in rows)
    return (f"RESULT load={load} {ratios} stalls={stalls} min_ratio={min(every):.2f} "
            f"rounds_below_1={below}/{len(every)} "
            f"stock_hangs={stock_hangs}/{runs} fixed_hangs={fixed_hangs}/{runs} build={build_type}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run, not for the record)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds per Python row (default 7, quick 3)")
    ap.add_argument("--native-rounds", type=int, default=None,
                    help="alternating rounds per native row (default 15, quick 5)")
    ap.add_argument("--load", choices=("quiet", "spin", "both"), default="quiet",
                    help="quiet; spin: with --spinners busy-looping processes; both: quiet, then spin")
    ap.add_argument("--spinners", type=int, default=3)
    ap.add_argument("--stall-ms", type=int, default=250)
    ap.add_argument("--out", type=Path, default=None, help="also write the output to this file")
    args = ap.parse_args()

    from kvdiag.allocator import native_module

    native = native_module()
    where, build = install_info(native)
    build_type = build.split(" ", 1)[0]
    say(f"kvdiag allocator benchmark  (cpus={os.cpu_count()}, python {sys.version.split()[0]})")
    for line in host_facts():
        say(line)
    say(f"install: {where}")
    say(f"build (stock and fixed alike): {build}")
    results = []
    for load in (("quiet", "spin") if args.load == "both" else (args.load,)):
        say("")
        if load == "quiet":
            results.append(run_table(native, args, load, build_type))
        else:
            # Bounded on their own in case this script dies without reaching __exit__.
            with Spinners(args.spinners, bound_s=1800.0):
                results.append(run_table(native, args, load, build_type))
    say("")
    for line in results:
        say(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
