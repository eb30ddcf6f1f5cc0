"""A real torch.distributed gloo job whose 2 ranks are Ray actors on two Ray nodes, each node in a network
namespace of its own (tests/fixtures/netns_pair.py, tests/fixtures/ranks/ray_gloo.py): rank 1 calls
broadcast where rank 0 calls all_reduce: `kvdiag capture --ray` names the collective mismatch and the rank
that left, across the nodes; the same ranks in a steady all_reduce loop are healthy. One cluster for both.

The cluster runs on a Python that has both Ray and torch (scripts/setup_ray_torch.sh makes one;
$KVDIAG_RAY_TORCH_PYTHON names another); kvdiag's capture runs on this interpreter, as a driver of that
cluster. Skipped where no such Python is found.

About 40-60 s on a loaded 2-core machine for both (two Ray nodes brought up, torch imported in each rank of
each job); the same rule on one host is test_ranks_gloo.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import netns_pair  # noqa: E402
import ray_host  # noqa: E402

JOB = Path(__file__).resolve().parents[1] / "fixtures" / "ranks" / "ray_gloo.py"
PYTHON = Path(os.environ.get("KVDIAG_RAY_TORCH_PYTHON", "~/.cache/kvdiag/ray-torch-venv/bin/python")).expanduser()
PORT = 29517


def _no_ray_torch_python() -> str | None:
    """Why no Python with Ray and torch can run the cluster (None: PYTHON can). Read from its files, not by
    importing both (seconds each): Ray's driver and cluster must agree on Ray's and Python's versions."""
    how = "scripts/setup_ray_torch.sh makes one, or set KVDIAG_RAY_TORCH_PYTHON"
    if not PYTHON.exists():
        return f"no Python with Ray and torch at {PYTHON} ({how})"
    site = sorted(PYTHON.parent.parent.glob("lib/python3*/site-packages"))   # a venv's (its python is a link)
    if not site or not (site[0] / "torch" / "distributed").is_dir():
        return f"{PYTHON} has no torch ({how})"
    try:
        ours = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return "ray is not installed for this Python"
    if not (site[0] / f"ray-{ours}.dist-info").is_dir():
        return f"{PYTHON} has no Ray {ours} (the version of this Python's Ray: driver and cluster must agree)"
    if site[0].parent.name != f"python{sys.version_info[0]}.{sys.version_info[1]}":
        return f"{PYTHON} is not a Python {sys.version_info[0]}.{sys.version_info[1]}, as this one"
    return None


_WHY = ray_host.unavailable() or netns_pair.unavailable() or _no_ray_torch_python()
pytestmark = [pytest.mark.timeout(360), pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]


@dataclass
class Cluster:
    net: netns_pair.NetnsPair
    gcs: str
    folder: Path


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with ray_host.two_node_cluster("kvrg-", 600, str(PYTHON), check_left=True) as (net, gcs, folder):
        yield Cluster(net, gcs, folder)


@contextmanager
def gloo_job(c: Cluster, mode: str, port: int) -> Iterator[dict[str, Any]]:
    """The job's ranks as actors (their pids and node ids, in rank order) once both are parked; the driver,
    and with it its actors, ended on the way out."""
    log = c.folder / f"driver-{mode}.log"
    driver = c.net.a.popen(str(PYTHON), str(JOB), c.gcs, c.net.a.address, str(port), str(c.folder), "kva", "kvb",
                           "--mode", mode, "--bound", "300", stdin=subprocess.PIPE,
                           stderr=open(log, "w"),  # noqa: SIM115 - the child's
                           env=dict(netns_pair._env(), RAY_USAGE_STATS_ENABLED="0"))
    try:
        assert driver.stdout is not None
        ready, _, _ = select.select([driver.stdout], [], [], 240)
        line = driver.stdout.readline().strip() if ready else ""
        assert line, "the gloo ranks did not come up: " + "".join(
            p.read_text()[-1500:] for p in (*c.folder.glob("ray-*.log"), log))
        yield json.loads(line)
    finally:
        try:
            if driver.stdin is not None:
                driver.stdin.close()     # the driver ends; Ray ends the actors it owns
            driver.wait(timeout=30)
        except (subprocess.TimeoutExpired, OSError):
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=10)


def _capture(c: Cluster, mode: str, out: Path) -> tuple[int, dict[str, Any], dict[str, Any]]:
    res = c.net.a.kvdiag("capture", "--ray", c.gcs, "--actor", f"gloo-{mode}-*", "--out", str(out), "--json",
                         timeout_s=240)
    assert res.returncode in (0, 10), res.stdout[-2000:] + res.stderr[-3000:]
    return res.returncode, json.loads(res.stdout)["verdict"], json.loads((out / "bundle" / "bundle.json").read_text())


def _ranks(bundle: dict[str, Any]) -> dict[int, tuple[str, int]]:
    return {p["rank"]["rank"]: (p["node"], p["pid"]) for p in bundle["processes"] if p.get("rank")}


def test_capture_ray_names_the_rank_that_left_across_nodes(cluster: Cluster, tmp_path: Path) -> None:
    with gloo_job(cluster, "mismatch", PORT) as job:
        code, v, bundle = _capture(cluster, "mismatch", tmp_path / "o")
    assert code == 10 and v["kind"] == "collective_mismatch", v["summary"]
    # Each rank on its own node, its identity read from its environment there.
    ranks = _ranks(bundle)
    assert set(ranks) == {0, 1} and [pid for _, pid in (ranks[0], ranks[1])] == job["ranks"], ranks
    node0, node1 = ranks[0][0], ranks[1][0]
    assert node0 != node1
    # each rank named with its node, and the step both are at (their frames' `step` local)
    assert v["summary"].startswith(f"rank 0 on {node0} waits in all_reduce (step 3) at ray_gloo.py"), v["summary"]
    assert f"rank 1 on {node1} is in broadcast (step 3) at ray_gloo.py" in v["summary"]
    assert "mismatched_broadcast" in v["summary"]
    # The chain: the waiting rank's collective on one node, to the rank that left on the other.
    edge = v["waits"]["edges"][0]
    assert edge["kind"] == "collective"
    assert (edge["src"]["node"], edge["src"]["pid"]) == ranks[0]
    assert (edge["dst"]["node"], edge["dst"]["pid"]) == ranks[1]
    cited = {(e["node"], e["pid"]) for e in v["evidence"]}
    assert {ranks[0], ranks[1]} <= cited


def test_ranks_in_a_steady_loop_across_nodes_are_healthy(cluster: Cluster, tmp_path: Path) -> None:
    with gloo_job(cluster, "healthy", PORT + 1) as job:
        code, v, bundle = _capture(cluster, "healthy", tmp_path / "o")
    assert code == 0 and v["kind"] == "healthy", v["summary"]
    ranks = _ranks(bundle)
    assert [pid for _, pid in (ranks[0], ranks[1])] == job["ranks"] and ranks[0][0] != ranks[1][0], ranks
