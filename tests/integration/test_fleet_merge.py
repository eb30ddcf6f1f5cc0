"""`kvdiag merge` of two captures taken on one host: a TCP client waits for the reply of a server whose
handler is stuck in a Python lock-order inversion, each captured on its own (`kvdiag capture --pid`) as if on
two hosts. Both are of the same boot and network namespace, so the merge refuses them (exit 2, one line):
its connections would be paired with themselves. Captures of two hosts: test_merge_tcp_hosts.py.
"""

from __future__ import annotations

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


def test_merge_refuses_two_captures_of_the_same_host(tmp_path: Path) -> None:
    server = _start(SERVER)
    client = None
    try:
        port = _line(server)
        client = _start(CLIENT, port)
        assert _line(client) == "READY" and _line(server) == "READY"
        for pid, node in ((client.pid, "node-a"), (server.pid, "node-b")):
            res = run_kvdiag("capture", "--pid", str(pid), "--no-follow", "--out", str(tmp_path / node), timeout=120)
            assert res.returncode in (0, 6, 10), res.stderr[-2000:]
    finally:
        for p in (client, server):
            if p is not None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    res = run_kvdiag("merge", str(tmp_path / "node-a"), str(tmp_path / "node-b"), "--out", str(tmp_path / "m"),
                     timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "same host" in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "m" / "report.json").exists()
