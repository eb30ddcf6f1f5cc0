"""`kvdiag merge` of captures taken separately, as on two hosts: a TCP client on "node a" waits for the
reply of a server on "node b" whose handler is stuck in a Python lock-order inversion. Each process is
captured on its own (`kvdiag capture --pid`, as `kubectl exec` in each pod would); the merge resolves the
client's read to the server by the connection's addresses and ports, and names the server's hang with the
chain client → server.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.kvcli import run_kvdiag

pytestmark = pytest.mark.timeout(180)

SERVER = textwrap.dedent("""
    import signal, socket, sys, threading
    signal.alarm(120)
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.recv(64)
    table_lock, index_lock = threading.Lock(), threading.Lock()
    both = threading.Barrier(2)
    def reindex():
        with index_lock:
            both.wait()
            with table_lock:
                pass
    threading.Thread(target=reindex, name="reindexer", daemon=True).start()
    with table_lock:
        both.wait()
        threading.Timer(0.3, lambda: print("READY", flush=True)).start()
        with index_lock:
            conn.sendall(b"done")
""")

CLIENT = textwrap.dedent("""
    import signal, socket, sys
    signal.alarm(120)
    c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    c.sendall(b"lookup")
    print("READY", flush=True)
    c.recv(4)
""")


def _start(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def _line(p: subprocess.Popen[str], timeout_s: float = 20) -> str:
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    assert ready, "the program did not signal readiness"
    return p.stdout.readline().strip()


def test_merge_resolves_a_tcp_read_to_the_hung_server_on_another_node(tmp_path: Path) -> None:
    server = _start(SERVER)
    client = None
    try:
        port = _line(server)
        client = _start(CLIENT, port)
        assert _line(client) == "READY" and _line(server) == "READY"
        for pid, node in ((client.pid, "node-a"), (server.pid, "node-b")):
            # --no-follow: on two real hosts the peer is not on this one to follow (here it is)
            res = run_kvdiag("capture", "--pid", str(pid), "--no-follow", "--out", str(tmp_path / node), timeout=120)
            assert res.returncode in (0, 6, 10), res.stderr[-2000:]
    finally:
        for p in (client, server):
            if p is not None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    res = run_kvdiag("merge", str(tmp_path / "node-a"), str(tmp_path / "node-b"), "--out", str(tmp_path / "m"),
                     "--json", timeout=120)
    assert res.returncode == 10, res.stderr[-2000:]
    v = json.loads(res.stdout)["verdict"]
    assert v["kind"] == "lock_order_inversion", v["summary"]
    assert {(e["node"], e["pid"]) for e in v["evidence"]} == {("node-a", client.pid), ("node-b", server.pid)}
    edge = v["waits"]["edges"][0]
    assert edge["kind"] == "socket_read" and f":{port}" in edge["evidence"]["address"]
    assert (edge["src"]["node"], edge["src"]["pid"], edge["dst"]["node"], edge["dst"]["pid"]) == (
        "node-a", client.pid, "node-b", server.pid)
    assert "waited on across nodes" in v["summary"]
