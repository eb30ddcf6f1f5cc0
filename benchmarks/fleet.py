"""Fleet capture through Ray: does capturing N nodes cost more wall time than capturing one?

For each cluster size (default 1, 2 and 4 nodes) a real local Ray cluster comes up in a network namespace
of its own (tests/fixtures/ray_cluster.py: one raylet and temp dir per node, one idle actor per node), and
``kvdiag capture --ray --select actors`` runs inside that namespace ``--rounds`` times. Measured per size:
the command's wall time (connect, discovery, one capture task per node in parallel, merge, analysis,
reports), the slowest node's capture as the driver saw it (task submitted → bundle back), and the bytes
each node sent back (its packed bundle folder). Ratios are against the 1-node cluster of the same run.
Target: N-node wall time <= 1.3 x the 1-node wall time. Beside it, Ray's own floor in the same cluster: a
fresh driver runs one no-op task pinned to every node (a new worker process on each, as a capture task gets)
and the CPU each such worker spent starting, before its task ran.

This machine has 2 cores: the N raylets, N actors and N capture tasks all share them, so the larger
clusters measure contention of the one host as much as the fleet code (on real nodes each capture has
its own cores).

    flock /tmp/kvdiag-bench.lock python benchmarks/fleet.py [--sizes 1,2,4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

from ray_host import ClusterHost, unavailable  # noqa: E402

TARGET_RATIO = 1.3

# Ray's own share of a node's capture: a fresh driver joins the cluster and runs one no-op task pinned
# to every node (a new worker process on each, as a capture task gets), nothing of kvdiag imported there.
# Printed: the seconds from submitting the tasks to the last answer, and the CPU each worker had spent
# before its task ran (its start and `import ray`).
_FLOOR = """
import json, os, resource, sys, time
import psutil, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as Pin
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
def noop():
    me = psutil.Process()
    t = me.cpu_times()
    return {"cpu_before": t.user + t.system, "age": time.time() - me.create_time()}
task = ray.remote(num_cpus=0, max_retries=0)(noop)
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
t0 = time.monotonic()
got = ray.get([task.options(scheduling_strategy=Pin(node_id=n, soft=False)).remote() for n in nodes])
wall = time.monotonic() - t0
ray.shutdown()
print(json.dumps({"tasks_s": wall, "cpu_before": sum(g["cpu_before"] for g in got) / len(got)}))
"""


def ray_floor(host: ClusterHost) -> dict[str, float]:
    res = host.python("-c", _FLOOR, host.info["address"])
    if res.returncode != 0:
        raise SystemExit(f"ray floor: exit {res.returncode}: {res.stderr[-1500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(nodes: int, rounds: int) -> dict[str, float]:
    host = ClusterHost(nodes=nodes, scenarios="idle")
    walls: list[float] = []
    slowest: list[float] = []
    driver: list[float] = []
    per_node_bytes: list[float] = []
    floors: list[dict[str, float]] = []
    try:
        t0 = time.monotonic()
        host.start()
        up = time.monotonic() - t0
        with tempfile.TemporaryDirectory(prefix="kvdiag-bench-fleet-") as tmp:
            for r in range(rounds):
                out = Path(tmp) / f"r{r}"
                start = time.monotonic()
                res = host.kvdiag("capture", "--ray", host.info["address"], "--select", "actors", "--out", str(out),
                                  "--json", timeout_s=180)
                walls.append(time.monotonic() - start)
                if res.returncode != 0:
                    raise SystemExit(f"{nodes} node(s): kvdiag exited {res.returncode}: {res.stderr[-2000:]}")
                bundle = json.loads((out / "bundle" / "bundle.json").read_text())
                table = [n for n in bundle["environment"]["nodes"] if n["outcome"] == "captured"]
                if len(table) != nodes:
                    raise SystemExit(f"{nodes} node(s): only {len(table)} captured: {bundle['environment']['nodes']}")
                slowest.append(max(n["capture_s"] for n in table))
                driver.append(sum(bundle["fleet"]["timings"].get(k, 0.0) for k in ("connect", "discover")))
                per_node_bytes.append(statistics.mean(n["bytes_moved"] for n in table))
                floors.append(ray_floor(host))
    finally:
        host.stop()
    return {"nodes": nodes, "up_s": up, "wall_s": statistics.median(walls), "node_s": statistics.median(slowest),
            "driver_s": statistics.median(driver),
            "bytes_per_node": statistics.median(per_node_bytes), "walls": walls,
            "floor_s": statistics.median(f["tasks_s"] for f in floors),
            "worker_cpu_s": statistics.median(f["cpu_before"] for f in floors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    why = unavailable()
    if why is not None:
        raise SystemExit(f"cannot run a local Ray cluster here: {why}")
    sizes = [int(s) for s in args.sizes.split(",")]
    began = time.monotonic()
    rows = [measure(n, args.rounds) for n in sizes]
    elapsed = time.monotonic() - began
    base = rows[0]
    print(f"fleet capture through Ray ({args.rounds} rounds per size, medians; load {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} CPUs; {elapsed:.0f} s in all, waits for /tmp/kvdiag-ray.lock included)")
    print(f"{'nodes':>5} {'cluster up s':>12} {'wall s':>7} {'ratio':>6} {'connect+discover s':>18} "
          f"{'slowest node s':>15} {'node ratio':>10} {'ray no-op s':>11} {'no-op ratio':>11} "
          f"{'worker start cpu s':>18} {'KiB/node':>9}  walls")
    for row in rows:
        print(f"{row['nodes']:>5} {row['up_s']:>12.1f} {row['wall_s']:>7.2f} {row['wall_s'] / base['wall_s']:>6.2f} "
              f"{row['driver_s']:>18.2f} {row['node_s']:>15.2f} {row['node_s'] / base['node_s']:>10.2f} "
              f"{row['floor_s']:>11.2f} {row['floor_s'] / base['floor_s']:>11.2f} {row['worker_cpu_s']:>18.2f} "
              f"{row['bytes_per_node'] / 1024:>9.0f}  " + " ".join(f"{w:.2f}" for w in row["walls"]))
    worst = max(rows[1:], key=lambda r: r["wall_s"] / base["wall_s"]) if len(rows) > 1 else base
    ratio = worst["wall_s"] / base["wall_s"]
    verdict = "met" if ratio <= TARGET_RATIO else "missed"
    print(f"target: N-node wall <= {TARGET_RATIO} x 1-node wall: {verdict} "
          f"(worst {ratio:.2f} at {worst['nodes']} nodes)")
    fields = {f"wall_{r['nodes']}n_s": f"{r['wall_s']:.2f}" for r in rows}
    fields |= {f"ratio_{r['nodes']}n": f"{r['wall_s'] / base['wall_s']:.2f}" for r in rows[1:]}
    fields |= {f"node_ratio_{r['nodes']}n": f"{r['node_s'] / base['node_s']:.2f}" for r in rows[1:]}
    fields |= {f"noop_{r['nodes']}n_s": f"{r['floor_s']:.2f}" for r in rows}
    fields["worker_start_cpu_s"] = f"{statistics.median(r['worker_cpu_s'] for r in rows):.2f}"
    fields["bytes_per_node"] = f"{statistics.mean(r['bytes_per_node'] for r in rows):.0f}"
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
