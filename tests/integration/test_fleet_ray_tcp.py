"""`kvdiag capture --ray` with one Ray node in each of two network namespaces (tests/fixtures/netns_pair.py):
actor tcp-client on node b waits for the reply of actor tcp-server on node a over TCP (b -> a's address),
whose handler is stuck in a native lock-order inversion (tests/fixtures/ray_tcp_pair.py). Nothing of Ray
says that one waits on the other; the connection's 4-tuple, matched across the two nodes' captures, does.

Slow (two Ray nodes brought up on a loaded 2-core machine: about a minute): the one Ray test of the TCP
matching; the same chain through `kvdiag merge` is test_merge_tcp_hosts.py.
"""

from __future__ import annotations

import json
import select
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import netns_pair  # noqa: E402
import ray_host  # noqa: E402

PAIR = Path(__file__).resolve().parents[1] / "fixtures" / "ray_tcp_pair.py"
PORT = 7000

_WHY = ray_host.unavailable() or netns_pair.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]


def test_capture_ray_follows_a_tcp_wait_from_one_nodes_actor_to_the_hang_on_the_other(tmp_path: Path) -> None:
    with ray_host.two_node_cluster("kvrt-", 400) as (net, gcs, folder):
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
    v = json.loads(res.stdout)["verdict"]
    assert res.returncode == 10 and v["kind"] == "lock_order_inversion", v["summary"]
    edge = v["waits"]["edges"][0]
    assert edge["kind"] == "socket_read" and f"{net.a.address}:{PORT}" in edge["evidence"]["address"]
    assert (edge["src"]["pid"], edge["dst"]["pid"]) == (pids["client"], pids["server"])
    assert edge["src"]["node"] != edge["dst"]["node"]
    stuck = [e for e in v["evidence"] if e["pid"] == pids["server"] and e["node"] == edge["dst"]["node"]]
    assert stuck and all(any("pthread_mutex_lock" in f for f in e["frames"]) for e in stuck)
