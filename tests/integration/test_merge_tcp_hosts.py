"""`kvdiag merge` of two hosts: two network namespaces made here, joined by a veth pair with addresses that
exist only inside them. A client on host b waits for the reply of a server on host a whose request handler
is stuck (a native lock-order inversion, or a GIL cycle). Each is captured inside its own namespace, as
`kubectl exec` in each pod would; merged, the verdict is the server's hang with its frames, reached by the
chain from the client's read over the connection b -> a. A healthy pair merged stays healthy.
"""

from __future__ import annotations

import importlib.util
import json
import select
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.kvcli import run_kvdiag

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import netns_pair  # noqa: E402

HANGERS = Path(__file__).resolve().parents[1] / "fixtures" / "hangers"
PORT = 7000

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(netns_pair.unavailable() is not None, reason=str(netns_pair.unavailable()))]


def _line(p: subprocess.Popen[str], timeout_s: float = 30) -> str:
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    assert ready, "the program did not signal readiness"
    return p.stdout.readline().strip()


def _captured_pair(tmp_path: Path, hang: str, bind: str | None = None, zmq: bool = False,
                   server_args: tuple[str, ...] = ()) -> tuple[int, int]:
    """Server on host a, client on host b, each captured in its namespace into tmp_path/host-a, host-b."""
    with netns_pair.NetnsPair() as net:
        server = net.a.popen(sys.executable, str(HANGERS / "tcp_server.py"), "--bind", bind or net.a.address,
                             "--port", str(PORT), "--hang", hang, "--bound", "150", *(("--zmq",) if zmq else ()),
                             *server_args)
        assert _line(server) == f"PORT {PORT}"
        loop = (("--loop",) if hang == "none" else ()) + (("--zmq",) if zmq else ())
        client = net.b.popen(sys.executable, str(HANGERS / "tcp_client.py"), "--connect", f"{net.a.address}:{PORT}",
                             "--bound", "150", *loop)
        assert _line(client) == "READY" and _line(server) == "READY"
        for host, pid in ((net.a, server.pid), (net.b, client.pid)):
            res = host.kvdiag("capture", "--pid", str(pid), "--out", str(tmp_path / f"host-{host.name}"))
            assert res.returncode in (0, 10), res.stdout[-1500:] + res.stderr[-1500:]
        return server.pid, client.pid


def _merge(tmp_path: Path) -> tuple[int, dict[str, object]]:
    res = run_kvdiag("merge", str(tmp_path / "host-b"), str(tmp_path / "host-a"), "--out", str(tmp_path / "m"),
                     "--json", timeout=120)
    assert res.returncode in (0, 10), res.stderr[-2000:]
    return res.returncode, json.loads(res.stdout)["verdict"]


@pytest.mark.parametrize(("hang", "kind", "frame", "bind"), [
    ("native", "lock_order_inversion", "pthread_mutex_lock", None),
    # a dual-stack listener: the server's side of the connection is ::ffff:10.231.39.1:7000 <- ::ffff:...
    ("gil", "gil_cycle", "alloc_page", "::"),
])
def test_merge_follows_a_tcp_wait_to_the_servers_hang_on_the_other_host(
        tmp_path: Path, hang: str, kind: str, frame: str, bind: str | None) -> None:
    server, client = _captured_pair(tmp_path, hang, bind)
    code, v = _merge(tmp_path)
    assert code == 10 and v["kind"] == kind, v["summary"]
    chain = v["waits"]
    edge = chain["edges"][0]
    assert edge["kind"] == "socket_read"
    assert (edge["src"]["node"], edge["src"]["pid"], edge["dst"]["node"], edge["dst"]["pid"]) == (
        "host-b", client, "host-a", server)
    assert f"{netns_pair.SUBNET}.1:{PORT}" in edge["evidence"]["address"]
    assert chain["root"]["node"] == "host-a" and chain["root"]["pid"] == server
    assert any(frame in f for f in chain["root_frames"]), chain["root_frames"]
    # the root's own evidence, with its frames, on the server's host
    root_items = [e for e in v["evidence"] if e["node"] == "host-a" and e["pid"] == server]
    assert root_items and any(frame in f for e in root_items for f in e["frames"])
    assert f"{netns_pair.SUBNET}.1:{PORT}" in v["summary"], v["summary"]


def test_merge_follows_a_connection_queued_unaccepted_to_the_listener_that_hangs(tmp_path: Path) -> None:
    # the server's main thread hangs before accepting: the connection has no fd there, only a queue entry
    server, client = _captured_pair(tmp_path, "native", server_args=("--no-accept",))
    code, v = _merge(tmp_path)
    assert code == 10 and v["kind"] == "lock_order_inversion", v["summary"]
    edge = v["waits"]["edges"][0]
    assert (edge["src"]["node"], edge["src"]["pid"], edge["dst"]["node"], edge["dst"]["pid"]) == (
        "host-b", client, "host-a", server)
    assert "listen queue" in edge["evidence"]["text"]


@pytest.mark.skipif(importlib.util.find_spec("zmq") is None, reason="pyzmq is not installed")
def test_merge_follows_a_zmq_request_over_tcp_to_the_servers_hang(tmp_path: Path) -> None:
    # libzmq's I/O thread holds the connection; the waiting thread parks on the socket's signaler
    server, client = _captured_pair(tmp_path, "native", zmq=True)
    code, v = _merge(tmp_path)
    assert code == 10 and v["kind"] == "lock_order_inversion", v["summary"]
    edge = v["waits"]["edges"][0]
    assert edge["kind"] == "zmq" and (edge["src"]["node"], edge["dst"]["node"], edge["dst"]["pid"]) == (
        "host-b", "host-a", server)
    assert any(e["node"] == "host-a" and e["pid"] == server for e in v["evidence"])


def test_a_healthy_pair_merged_stays_healthy(tmp_path: Path) -> None:
    _captured_pair(tmp_path, "none")
    code, v = _merge(tmp_path)
    assert code == 0 and v["kind"] == "healthy", v["summary"]
