"""Fleet capture through a real local Ray cluster: 5 nodes (raylets with their own temp dirs) in a network
namespace of its own, actors that really hang, kvdiag run inside that namespace.

Actor ``<s>-a`` on node 0 calls actor ``<s>-b`` on node 1 and waits in ``ray.get``; B is stuck in a native
lock-order inversion (``native``), a Python ABBA between its method's thread and a second thread
(``pyabba``), or answers at once (``healthy``). ``lone-c`` idles on node 2, the node one test kills.
Node 3 runs Ray on a Python without kvdiag, node 4 under a seccomp filter refusing ptrace; an idle actor
on each (``no-kvdiag-c``, ``no-ptrace-c``). One cluster for the module; the destructive test runs last.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from ray_host import ClusterHost, unavailable  # noqa: E402

pytestmark = pytest.mark.timeout(420)

_WHY = unavailable()


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterHost]:
    if _WHY is not None:
        pytest.skip(_WHY)
    host = ClusterHost(nodes=5, scenarios="native,pyabba,healthy,lone",
                       extra=("--special", "3=no-kvdiag", "--special", "4=no-ptrace"))
    try:
        info = host.start()
        assert info["ready"], "the hanging actors did not signal readiness"
        yield host
    finally:
        host.stop()
    assert host.left_in_namespace() == [], "processes of the cluster survived its teardown"
    assert not host.dir.exists()


def _capture(host: ClusterHost, out: Path, *args: str) -> tuple[int, dict[str, Any], dict[str, Any]]:
    res = host.kvdiag("capture", "--ray", host.info["address"], *args, "--out", str(out), "--json")
    assert res.returncode in (0, 10), \
        f"exit {res.returncode}\nstdout: {res.stdout[-3000:]}\nstderr: {res.stderr[-3000:]}"
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    return res.returncode, json.loads(res.stdout), bundle


def _node(bundle: dict[str, Any], node_id: str) -> dict[str, Any]:
    return next(n for n in bundle["environment"]["nodes"] if n["node_id"] == node_id)


def test_native_lock_cycle_named_with_the_chain_across_nodes(cluster: ClusterHost, tmp_path: Path) -> None:
    a, b = cluster.actor("native-a"), cluster.actor("native-b")
    code, out, bundle = _capture(cluster, tmp_path / "o", "--actor", "native-*")
    v = out["verdict"]
    assert code == 10 and v["kind"] == "lock_order_inversion", v["summary"]
    node_a, node_b = _node(bundle, a["node_id"])["node"], _node(bundle, b["node_id"])["node"]
    assert node_a != node_b
    stuck = [e for e in v["evidence"] if e["pid"] == b["pid"] and e["node"] == node_b]
    assert len(stuck) == 2 and all(any("pthread_mutex_lock" in f for f in e["frames"]) for e in stuck)
    waiter = [e for e in v["evidence"] if e["pid"] == a["pid"] and e["node"] == node_a]
    assert waiter and any("get" in f for f in waiter[0]["frames"]), v["evidence"]
    assert f"node {node_a} pid {a['pid']}" in v["summary"] and "waited on across nodes" in v["summary"]
    edge = v["waits"]["edges"][0]   # the typed chain: A's thread in ray.get -> B's process, on another node
    assert edge["kind"] == "ray_get" and (edge["src"]["node"], edge["src"]["pid"]) == (node_a, a["pid"])
    assert (edge["dst"]["node"], edge["dst"]["pid"]) == (node_b, b["pid"])
    # processes keyed by node and pid; a node table in the environment; raw files kept per node
    assert {(p["node"], p["pid"]) for p in bundle["processes"]} == {(node_a, a["pid"]), (node_b, b["pid"])}
    assert {n["outcome"] for n in bundle["environment"]["nodes"]} >= {"captured", "no_targets"}
    raw = [t["raw_path"] for p in bundle["processes"] for t in p["tools"] if t.get("raw_path")]
    assert raw and all((tmp_path / "o" / "bundle" / r).is_file() for r in raw)
    assert bundle["fleet"]["source"] == "ray" and bundle["fleet"]["tasks"]


def test_python_abba_inside_a_ray_worker_is_a_lock_order_inversion(cluster: ClusterHost, tmp_path: Path) -> None:
    b = cluster.actor("pyabba-b")
    code, out, _ = _capture(cluster, tmp_path / "o", "--actor", "pyabba-*")
    v = out["verdict"]
    assert code == 10 and v["kind"] == "lock_order_inversion", v["summary"]
    cited = [e for e in v["evidence"] if e["pid"] == b["pid"]]
    assert len(cited) == 2, cited
    frames = [" ".join(e["frames"]) for e in cited]
    assert any("work" in f for f in frames) and any("report_stats" in f for f in frames)
    assert "waited on across nodes" in v["summary"]


def test_one_hang_signs_the_same_however_it_was_selected(cluster: ClusterHost, tmp_path: Path) -> None:
    """The signature depends on the hang, not on how it was captured: the caller and the hung actor (default
    selection) and the hung actor alone (``--select actors --actor NAME``) sign alike; another hang of the
    same kind (the Python ABBA) signs differently."""
    b = cluster.actor("native-b")
    _, pair, _ = _capture(cluster, tmp_path / "pair", "--actor", "native-*")
    _, alone, alone_bundle = _capture(cluster, tmp_path / "alone", "--select", "actors", "--actor", "native-b")
    _, other, _ = _capture(cluster, tmp_path / "other", "--select", "actors", "--actor", "pyabba-b")
    p, a, o = pair["verdict"], alone["verdict"], other["verdict"]
    assert {p["kind"], a["kind"], o["kind"]} == {"lock_order_inversion"}, (p["summary"], a["summary"], o["summary"])
    assert {pr["pid"] for pr in alone_bundle["processes"]} == {b["pid"]}   # the waiter really was left out
    assert p["signature"] and p["signature"] == a["signature"], (p["signature"], a["signature"])
    assert o["signature"] and o["signature"] != p["signature"]
    assert str(b["pid"]) not in p["signature"]


def test_healthy_pair_is_healthy(cluster: ClusterHost, tmp_path: Path) -> None:
    code, out, bundle = _capture(cluster, tmp_path / "o", "--actor", "healthy-*")
    assert code == 0 and out["verdict"]["kind"] == "healthy", out["verdict"]["summary"]
    assert len(bundle["processes"]) == 2


def test_nodes_without_kvdiag_or_ptrace_are_named_with_why_and_the_rest_judged(cluster: ClusterHost,
                                                                               tmp_path: Path) -> None:
    out = tmp_path / "o"
    # From outside kvdiag's tree: Ray puts the driver's working directory on every worker's path.
    res = cluster.kvdiag("capture", "--ray", cluster.info["address"], "--select", "actors", "--actor", "healthy-*",
                         "--actor", "no-*", "--timeout", "3", "--out", str(out), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]     # healthy where it could be judged: no hang evidence
    v = json.loads(res.stdout)["verdict"]
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    assert v["kind"] == "healthy" and v["confidence"] != "high", v["summary"]
    no_kvdiag = _node(bundle, cluster.actor("no-kvdiag-c")["node_id"])
    assert no_kvdiag["outcome"] == "refused", no_kvdiag
    assert "kvdiag is not importable by the Python Ray runs on that node" in no_kvdiag["reason"]
    assert "No module named 'kvdiag'" in no_kvdiag["reason"] and "site-packages" in no_kvdiag["reason"]
    no_ptrace = _node(bundle, cluster.actor("no-ptrace-c")["node_id"])
    assert no_ptrace["outcome"] == "refused", no_ptrace
    assert no_ptrace["reason"].startswith("ptrace refused: the kernel refused gdb and pystack"), no_ptrace["reason"]
    assert "seccomp filter" in no_ptrace["reason"] and "SYS_PTRACE" in no_ptrace["reason"]
    # The normal nodes: captured and judged, both actors' stacks read.
    healthy = {cluster.actor(n)["pid"]: _node(bundle, cluster.actor(n)["node_id"]) for n in ("healthy-a", "healthy-b")}
    assert all(n["outcome"] == "captured" for n in healthy.values())
    judged = {p["pid"]: p for p in bundle["processes"]}
    assert set(healthy) <= set(judged) and all(judged[pid]["threads"] for pid in healthy)
    assert cluster.actor("no-kvdiag-c")["pid"] not in judged
    assert v["summary"].startswith(tuple(n["node"] for n in healthy.values())), v["summary"]   # not a refused node
    # Each special node is named with why: in the verdict, its findings and both reports' text.
    for node in (no_kvdiag, no_ptrace):
        assert any(f["kind"] == "node_not_captured" and f["node"] == node["node"] for f in v["findings"])
        assert node["node"] in v["summary"].rsplit("not captured: ", 1)[1]
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    for text in ("No module named", "ptrace refused: the kernel refused gdb and pystack"):
        assert text in md and text in html, text


def test_node_killed_during_capture_is_named_and_the_rest_reported(cluster: ClusterHost, tmp_path: Path) -> None:
    lone = cluster.actor("lone-c")
    cluster.command("kill-on-capture 2")
    code, out, bundle = _capture(cluster, tmp_path / "o", "--actor", "healthy-*", "--actor", "lone-*")
    assert cluster.read_line(30) == "killed"
    dead = _node(bundle, lone["node_id"])
    assert dead["outcome"] == "died", dead
    v = out["verdict"]
    assert code == 0 and v["kind"] == "healthy", v["summary"]
    assert f"not captured: {dead['node']}" in v["summary"]
    assert any(f["kind"] == "node_not_captured" and f["node"] == dead["node"] for f in v["findings"])
    healthy = {cluster.actor("healthy-a")["pid"], cluster.actor("healthy-b")["pid"]}
    assert healthy <= {p["pid"] for p in bundle["processes"]}
    # Under load Ray may start a worker for the lost actor elsewhere that exits at once (a zombie nobody reaps in
    # the namespace): it is captured, judged as nothing to judge, and named beside the verdict, never instead of it.
    for name, each in out["verdicts_by_engine"].items():
        if not any(str(pid) in name for pid in healthy):
            assert each["kind"] in ("exited", "zombie", "healthy"), (name, each["summary"])
