"""Map and unmap latency per page, stock vs fixed allocator, on one backend (``cuda`` on a GPU host).

    python benchmarks/map_latency.py [--backend cuda|host] [--pages N] [--rounds R]

Each allocator gets the seed's engine-2 geometry (28 layers, 2 MB pages) with no reserve and no
prealloc, so every ``alloc_page`` maps one page in all 28 layers synchronously and every ``free_page``
followed by ``trim`` unmaps it: the per-call wall time is the backend's map (cuMemCreate + cuMemMap +
cuMemSetAccess per layer on ``cuda``) or unmap, plus the allocator's own work. Rounds alternate which
allocator goes first (the baseline, stock, is measured in the same run). Prints p50/p99 per allocator
and operation and ends with ``RESULT stock_map_p50_us=... stock_map_p99_us=... fixed_map_p50_us=...``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from kvdiag.allocator import make_allocator

MB = 1024 * 1024
GEOMETRY = {"num_layers": 28, "mem_size_per_layer": 64 * MB, "page_size": 2 * MB, "world_size": 1, "pp_rank": 0,
            "async_sched": False, "contiguous_layout": True, "num_kv_buffers": 2, "group_id": 0}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def one_round(kind: str, backend: str, pages: int) -> tuple[list[float], list[float], dict[str, Any]]:
    alloc = make_allocator(kind, enable_prealloc=False, min_reserved_pages=0, max_reserved_pages=0, backend=backend,
                           print_banner=False, device_name=f"kvdiag-lat-{kind}-{os.getpid()}", **GEOMETRY)
    maps: list[float] = []
    unmaps: list[float] = []
    for _ in range(pages):
        t0 = time.perf_counter()
        page = alloc.alloc_page()
        t1 = time.perf_counter()
        alloc.free_page(page)
        alloc.trim()
        t2 = time.perf_counter()
        maps.append((t1 - t0) * 1e6)
        unmaps.append((t2 - t1) * 1e6)
    counters = dict(alloc.counters())
    del alloc
    return maps, unmaps, counters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--pages", type=int, default=200, help="map+unmap cycles per allocator per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    got: dict[str, dict[str, list[float]]] = {k: {"map": [], "unmap": []} for k in ("stock", "fixed")}
    counts: dict[str, dict[str, Any]] = {}
    for r in range(args.rounds):
        for kind in (("stock", "fixed") if r % 2 == 0 else ("fixed", "stock")):
            maps, unmaps, counters = one_round(kind, args.backend, args.pages)
            got[kind]["map"] += maps
            got[kind]["unmap"] += unmaps
            counts[kind] = counters
    print(f"backend {args.backend}, {args.pages} pages x {args.rounds} rounds per allocator, 28 layers x 2 MB pages")
    print(f"{'allocator':<10}{'op':<7}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}{'max us':>10}")
    result: list[str] = []
    for kind in ("stock", "fixed"):
        for op in ("map", "unmap"):
            vals = got[kind][op]
            p50, p99 = pct(vals, 0.5), pct(vals, 0.99)
            print(f"{kind:<10}{op:<7}{p50:>10.1f}{p99:>10.1f}{statistics.fmean(vals):>10.1f}{max(vals):>10.1f}")
            result += [f"{kind}_{op}_p50_us={p50:.1f}", f"{kind}_{op}_p99_us={p99:.1f}"]
    for kind, c in counts.items():
        print(f"{kind} counters (last round): " + ", ".join(f"{k}={v}" for k, v in sorted(c.items())))
    print("RESULT " + " ".join(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
