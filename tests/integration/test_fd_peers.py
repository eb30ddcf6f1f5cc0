"""osread's sock_diag dump and /proc/*/fd scan (and capture/fds.py over them) on real sockets: complete, bounded.

A child process holds thousands of Unix socketpairs (more than fill one netlink reply) and one end of a
pipe; kvdiag's lookups must find every pair and the child as the holder, and must say "partial" (never
pass a cut table as complete) when the deadline is spent.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvdiag.capture.fds import FdResolver
from kvdiag.osread.fds import inode_holders
from kvdiag.osread.sockdiag import unix_sockets

PAIRS = 3000
HOLDER = """
import os, resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * {pairs} + 256)), hard))
pairs = [socket.socketpair() for _ in range({pairs})]
r, w = os.pipe()
print(" ".join(str(os.fstat(s.fileno()).st_ino) for a, b in pairs[:: {step}] for s in (a, b)), os.fstat(w).st_ino,
      flush=True)
sys.stdin.read()
"""


@pytest.fixture()
def holder() -> Iterator[tuple[subprocess.Popen[str], list[int], int]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * PAIRS + 256:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {2 * PAIRS + 256}")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(pairs=PAIRS, step=PAIRS // 50)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()    # bounded by the test timeout; the child prints once ready
        assert line, "the holder process did not start"
        yield proc, [int(x) for x in line[:-1]], int(line[-1])
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.timeout(120)
def test_sock_diag_dump_is_read_to_the_end(holder: tuple[subprocess.Popen[str], list[int], int]) -> None:
    _, inodes, _ = holder
    dump = unix_sockets(time.monotonic() + 30)
    peers, partial = dump.peers(), dump.partial
    assert partial is None
    assert len(peers) >= 2 * PAIRS
    for a, b in zip(inodes[::2], inodes[1::2], strict=True):   # sampled across all the pairs, last ones too
        assert peers.get(a) == b and peers.get(b) == a


@pytest.mark.timeout(120)
def test_a_spent_deadline_says_partial_never_complete(holder: tuple[subprocess.Popen[str], list[int], int]) -> None:
    proc, inodes, pipe_inode = holder
    partial = unix_sockets(time.monotonic() - 1).partial
    assert partial is not None and "deadline" in partial
    owners, scan_partial = inode_holders({pipe_inode}, os.getpid(), time.monotonic() - 1)
    assert scan_partial is not None and "deadline" in scan_partial


@pytest.mark.timeout(120)
def test_owner_scan_finds_the_holder_among_every_process(holder: tuple[subprocess.Popen[str], list[int], int]) -> None:
    proc, inodes, pipe_inode = holder
    start = time.monotonic()
    owners, partial = inode_holders({pipe_inode, inodes[-1]}, os.getpid(), time.monotonic() + 60)
    assert partial is None
    assert owners.get(pipe_inode) == [proc.pid] and owners.get(inodes[-1]) == [proc.pid]
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
def test_resolver_names_the_peer_process_of_a_socket(holder: tuple[subprocess.Popen[str], list[int], int]) -> None:
    """Our end of a socketpair whose other end only the holder process has: peer = the holder."""
    proc, _, _ = holder
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             pass_fds=(theirs.fileno(),))
    try:
        theirs.close()
        info = FdResolver(os.getpid(), time.monotonic() + 30).describe([ours.fileno()])[0]
        assert info.kind == "socket" and info.proto == "unix" and info.partial is None
        assert info.peer_pids == [child.pid]
    finally:
        child.kill()
        child.wait(timeout=10)
        ours.close()
