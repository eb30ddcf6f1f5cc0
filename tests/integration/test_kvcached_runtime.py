"""kvcached's live state: a memory-info segment and a worker socket, with real processes at each end."""

from __future__ import annotations

import os
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvdiag.kvcached.runtime import collect_runtime

pytestmark = pytest.mark.timeout(120)

# A worker: binds the socket, opens the segment, says READY, then waits for its stdin to close.
WORKER = r"""
import os, socket, sys
seg = open(sys.argv[2], "rb")
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1]); srv.listen(4)
print("READY", flush=True)
conn, _ = srv.accept()
print("ACCEPTED", flush=True)
sys.stdin.read()
"""
# An engine with a call in flight: connects, says READY, waits.
CLIENT = r"""
import socket, sys
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.connect(sys.argv[1])
print("READY", flush=True)
sys.stdin.read()
"""


def _start(code: str, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()   # readiness handshake; the child exits if the parent dies (stdin EOF)
    assert line.strip() == "READY", line
    return proc


def test_segment_and_socket_with_their_processes(tmp_path: Path) -> None:
    tag = f"kvdiagtest_{os.getpid()}_{secrets.token_hex(3)}"
    seg = Path("/dev/shm") / tag
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-rt-"))
    sock_dir = tmp / f"kvcached-tp-{tag}-0a1b2c3d"
    sock_dir.mkdir()
    sock = sock_dir / "w0.sock"
    procs: list[subprocess.Popen[str]] = []
    try:
        seg.write_bytes(struct.pack("<qqq", 4 << 30, 1 << 30, 10 << 20))
        worker = _start(WORKER, str(sock), str(seg))
        procs.append(worker)
        client = _start(CLIENT, str(sock))
        procs.append(client)
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ACCEPTED"
        rt = collect_runtime(tmp_dir=tmp, segment_prefixes=(tag,))
        assert rt is not None
        assert [s.name for s in rt.segments] == [tag]
        s = rt.segments[0]
        assert (s.total_bytes, s.used_bytes, s.prealloc_bytes) == (4 << 30, 1 << 30, 10 << 20)
        assert worker.pid in s.pids and client.pid not in s.pids
        assert [k.path for k in rt.sockets] == [str(sock)]
        k = rt.sockets[0]
        assert k.listener_pids == [worker.pid] and not k.stale
        if not rt.notes or "sock_diag" not in rt.notes[0]:
            assert k.peer_pids == [client.pid]
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        seg.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)


def test_stale_socket_and_nothing_found(tmp_path: Path) -> None:
    assert collect_runtime(shm_dir=tmp_path / "shm", tmp_dir=tmp_path) is None
    d = tmp_path / "kvcached-tp-gone-12345678"
    d.mkdir()
    (d / "w0.sock").touch()
    rt = collect_runtime(shm_dir=tmp_path / "shm", tmp_dir=tmp_path)
    assert rt is not None and rt.sockets[0].stale and rt.sockets[0].listener_pids == []
