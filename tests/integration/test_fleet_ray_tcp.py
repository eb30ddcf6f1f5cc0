"""`kvdiag capture --ray` with one Ray node in each of two network namespaces (tests/fixtures/netns_pair.py):
actor tcp-client on node b waits for the reply of actor tcp-server on node a over TCP (b -> a's address),
whose handler is stuck in a native lock-order inversion (tests/fixtures/ray_tcp_pair.py). Nothing of Ray
says that one waits on the other; the connection's 4-tuple, matched across the two nodes' captures, does.

Slow (two Ray nodes brought up on a loaded 2-core machine: about a minute): the one Ray test of the TCP
matching; the same chain through `kvdiag merge` is test_merge_tcp_hosts.py.
"""

from __future__ import annotations

import fcntl
import json
import select
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import netns_pair  # noqa: E402
import ray_host  # noqa: E402

PAIR = Path(__file__).resolve().parents[1] / "fixtures" / "ray_tcp_pair.py"
PORT = 7000

_WHY = ray_host.unavailable() or netns_pair.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]


def _ray_start(host: netns_pair.Host, folder: Path, *args: str) -> None:
    log = open(folder / f"ray-{host.name}.log", "w")  # noqa: SIM115 - the child's; closed when it ends
    env = dict(netns_pair._env(), RAY_USAGE_STATS_ENABLED="0")
    host.popen(sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--node-ip-address={host.address}",
               "--num-cpus=1", "--num-gpus=0", f"--resources={{\"n{host.name}\": 1}}",
               f"--object-store-memory={100 * 1024 * 1024}", f"--temp-dir={folder / host.name}", *args,
               stdout=log, stderr=log, stdin=None, env=env)


def test_capture_ray_follows_a_tcp_wait_from_one_nodes_actor_to_the_hang_on_the_other(tmp_path: Path) -> None:
    folder = Path(tempfile.mkdtemp(prefix="kvrt-"))    # short: Ray's unix socket paths must fit
    lock = open(ray_host.LOCK, "a")  # noqa: SIM115 - one Ray cluster at a time on the machine
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        with netns_pair.NetnsPair(bound_s=400) as net:
            gcs = f"{net.a.address}:6379"
            _ray_start(net.a, folder, "--head", "--port=6379", "--include-dashboard=true",
                       f"--dashboard-host={net.a.address}")
            _ray_start(net.b, folder, f"--address={gcs}")
            driver = net.a.popen(sys.executable, str(PAIR), gcs, net.a.address, str(PORT), str(folder),
                                 stdin=-1, env=dict(netns_pair._env(), RAY_USAGE_STATS_ENABLED="0"))
            assert driver.stdout is not None
            ready, _, _ = select.select([driver.stdout], [], [], 240)
            line = driver.stdout.readline().strip() if ready else ""
            assert line, "the Ray pair did not come up: " + "".join(
                p.read_text()[-1500:] for p in folder.glob("ray-*.log"))
            pids = json.loads(line)
            res = net.a.kvdiag("capture", "--ray", gcs, "--actor", "tcp-*", "--out", str(tmp_path / "o"), "--json",
                               timeout_s=240)
            assert res.returncode in (0, 10), res.stdout[-2000:] + res.stderr[-3000:]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        lock.close()
    v = json.loads(res.stdout)["verdict"]
    assert res.returncode == 10 and v["kind"] == "lock_order_inversion", v["summary"]
    edge = v["waits"]["edges"][0]
    assert edge["kind"] == "socket_read" and f"{net.a.address}:{PORT}" in edge["evidence"]["address"]
    assert (edge["src"]["pid"], edge["dst"]["pid"]) == (pids["client"], pids["server"])
    assert edge["src"]["node"] != edge["dst"]["node"]
    stuck = [e for e in v["evidence"] if e["pid"] == pids["server"] and e["node"] == edge["dst"]["node"]]
    assert stuck and all(any("pthread_mutex_lock" in f for f in e["frames"]) for e in stuck)
