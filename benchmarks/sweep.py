"""Sweep throughput: cells per minute of `kvdiag sweep` on the simulated engines, against the
by-hand baseline (one `kvdiag repro` per setting, the scenario's own 5 s stall window, one at a time).

Grid: pool pages per layer (engine vlm's kv_per_layer_mb in 2 MB steps) x min_reserved_pages, stock
allocator, prealloc on. Every cell must come out as the seed's rule says (hang exactly when pages per
layer <= min_reserved_pages) and the sweep must state that rule. The sweep runs with its own TMPDIR; after
it, no process of it, no file in that TMPDIR and no new kvdiag file in /dev/shm may be left.

    python benchmarks/sweep.py [--pages 4] [--reserved 4] [--jobs 0] [--engines vlm] [--full]
                               [--also-jobs N] [--also-engines vlm]

``--full``: the 100-cell grid (10 x 10). Without it: a 4 x 4 grid, with the projected 100-cell time.
Run under `flock /tmp/kvdiag-bench.lock`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_100_S = 600.0


def kvdiag(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, float, str]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-P", "-m", "kvdiag", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)
    return proc.returncode, time.monotonic() - start, proc.stdout + proc.stderr


def leftovers(tmp: Path, out: Path) -> list[str]:
    """Processes started under the sweep's TMPDIR, files left in it, and the modelled-device files in
    /dev/shm of the devices its runs used (named in the engines' logs)."""
    found: list[str] = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            environ = (pid_dir / "environ").read_bytes()
        except OSError:
            continue
        if f"TMPDIR={tmp}".encode() in environ.split(b"\0"):
            found.append(f"process {pid_dir.name}")
    found += [f"tmp {p}" for p in tmp.iterdir() if p.name != "out"] if tmp.exists() else []
    devices = {m for log in out.glob("cells/*/run-*/bundle/logs/*.log")
               for m in re.findall(r"device=(\S+?),", log.read_text(errors="replace"))}
    for name in sorted(devices):
        found += [str(p) for p in (Path(f"/dev/shm/kvdiag-dev-{name}.acct"), Path(f"/dev/shm/kvdiag-vmm-{name}.lock"))
                  if p.exists()]
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=4, help="pages per layer 1..N")
    ap.add_argument("--reserved", type=int, default=4, help="min_reserved_pages 1..N")
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--full", action="store_true", help="the 100-cell grid (10 x 10)")
    ap.add_argument("--also-jobs", type=int, default=0,
                    help="then the same sweep with --jobs N (and --also-engines), timed right after, for comparison")
    ap.add_argument("--also-engines", default=None)
    ap.add_argument("--engines", default=None, help="pass --engines NAMES to the sweep (e.g. vlm)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the sweep's output folder here")
    args = ap.parse_args()
    if args.full:
        args.pages, args.reserved = 10, 10
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-bench-sweep-"))
    keep = True
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = args.keep or (tmp.parent / f"{tmp.name}-out")
    load0 = os.getloadavg()[0]
    try:
        # Baseline: the by-hand way, one repro per setting with the scenario's own window (a hang and a healthy one).
        base: dict[str, float] = {}
        for name, mb, res in (("hang", 2, 1), ("healthy", 4, 1)):
            scen = tmp / f"base-{name}.yaml"
            text = (ROOT / "scenarios" / "two-engine.yaml").read_text()
            text = text.replace("      kv_per_layer_mb: 11\n", f"      kv_per_layer_mb: {mb}\n").replace(
                "      min_reserved_pages: 5\n      max_reserved_pages: 5\n",
                f"      min_reserved_pages: {res}\n      max_reserved_pages: 5\n")
            scen.write_text(text)
            rc, wall, _ = kvdiag(["repro", "two-engine", "--scenario", str(scen), "--out", str(tmp / f"base-{name}")],
                                 env, 300)
            expect = 10 if name == "hang" else 0
            if rc != expect:
                print(f"baseline {name}: exit {rc}, expected {expect}")
                return 1
            base[name] = wall
            shutil.rmtree(tmp / f"base-{name}", ignore_errors=True)
            scen.unlink()
        cells = args.pages * args.reserved
        hang_cells = sum(1 for p in range(1, args.pages + 1) for r in range(1, args.reserved + 1) if p <= r)
        by_hand = hang_cells * base["hang"] + (cells - hang_cells) * base["healthy"]
        sweep_args = ["sweep", "--vary", f"engines.vlm.sim.kv_per_layer_mb=2..{2 * args.pages}:2",
                      "--vary", f"engines.vlm.sim.min_reserved_pages=1..{args.reserved}", "--out", str(out)]
        if args.jobs:
            sweep_args += ["--jobs", str(args.jobs)]
        if args.engines:
            sweep_args += ["--engines", args.engines]
        rc, wall, text = kvdiag(sweep_args, env, 3600)
        report = json.loads((out / "report.json").read_text())
        wrong = []
        for c in report["cells"]:
            pages = int(c["params"]["kv_per_layer_mb"]) // 2
            hung = c["outcome"] == "hang"
            if hung != (pages <= c["params"]["min_reserved_pages"]) or c["outcome"] not in ("hang", "healthy"):
                wrong.append(f"{c['params']}: {c['outcome']}")
        rule = report["rule"]["text"]
        rule_ok = "pages per layer ≤ min_reserved_pages" in rule and report["rule"]["fits"]
        time.sleep(1.0)
        left = leftovers(tmp, out)
        keep = (args.keep is not None or bool(wrong) or not rule_ok or rc != 10
                or not report["banner_check"]["agree"])
        also: tuple[float, int, int, int] | None = None
        if args.also_jobs or args.also_engines:
            out2 = tmp.parent / f"{tmp.name}-out2"
            alt = list(sweep_args)
            for flag in ("--out", "--jobs", "--engines"):
                if flag in alt:
                    i = alt.index(flag)
                    del alt[i:i + 2]
            alt += ["--out", str(out2)]
            alt += ["--jobs", str(args.also_jobs)] if args.also_jobs else []
            alt += ["--engines", args.also_engines] if args.also_engines else []
            rc2, wall2, _ = kvdiag(alt, env, 3600)
            rep2 = json.loads((out2 / "report.json").read_text())
            bad2 = sum(1 for c in rep2["cells"] if (c["outcome"] == "hang") !=
                       (int(c["params"]["kv_per_layer_mb"]) // 2 <= c["params"]["min_reserved_pages"]))
            time.sleep(1.0)
            also = (wall2, bad2, len(leftovers(tmp, out2)), rep2["jobs"])
            shutil.rmtree(out2, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        else:
            print(f"output kept in {out}")
        shutil.rmtree(tmp, ignore_errors=True)
    per_min = cells / wall * 60
    projected = 100 / per_min * 60
    runs = [r for c in report["cells"] for r in c["runs"]]
    hang_wall = sorted(r["wall_s"] for r in runs if r["outcome"] == "hang")
    ok_wall = sorted(r["wall_s"] for r in runs if r["outcome"] == "healthy")
    print(f"grid: {args.pages} pages x {args.reserved} min_reserved = {cells} cells ({hang_cells} hang), "
          f"engines {args.engines or 'all'}, "
          f"jobs {report['jobs']}, stall window {report['stall_window_s']} s, "
          f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'':24}{'wall s':>10}{'cells/min':>12}{'100 cells':>12}")
    print(f"{'by hand (repro each)':24}{by_hand:>10.1f}{cells / by_hand * 60:>12.1f}{100 / (cells / by_hand):>11.0f}s")
    print(f"{'kvdiag sweep':24}{wall:>10.1f}{per_min:>12.1f}{projected:>11.0f}s")
    extra = ""
    if also is not None:
        label = f"  jobs {also[3]}, engines {args.also_engines or args.engines or 'all'}"
        print(f"{label:24}{also[0]:>10.1f}{cells / also[0] * 60:>12.1f}{100 / (cells / also[0]):>11.0f}s"
              f"  (wrong cells {also[1]}, leftovers {also[2]})")
        extra = f" also_cells_per_min={cells / also[0] * 60:.1f} also_wrong_cells={also[1]} also_leftovers={also[2]}"
    print(f"baseline runs: hang {base['hang']:.1f} s, healthy {base['healthy']:.1f} s; sweep runs: hang median "
          f"{hang_wall[len(hang_wall) // 2] if hang_wall else 0:.1f} s, healthy median "
          f"{ok_wall[len(ok_wall) // 2] if ok_wall else 0:.1f} s (one run's wall, {report['jobs']} at a time)")
    print(f"rule: {rule} ({'recovered' if rule_ok else 'NOT recovered'}); wrong cells: {len(wrong)} {wrong[:5]}")
    print(f"banner check: {report['banner_check']['text']}")
    print(f"sweep exit code {rc}; leftovers: {left or 'none'}")
    met = int(projected < TARGET_100_S and not wrong and rule_ok and not left and rc == 10)
    print(f"RESULT cells_per_min={per_min:.1f} projected_100_cells_s={projected:.0f} cells={cells} wall_s={wall:.1f} "
          f"speedup_vs_by_hand={by_hand / wall:.2f} wrong_cells={len(wrong)} rule_recovered={int(rule_ok)} "
          f"leftovers={len(left)} target_met={met}{extra}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
