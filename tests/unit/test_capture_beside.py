"""What runs beside a capture: started once the /proc windows are open, the TCP tables read once per
network namespace, and the multiprocessing helper that gets no pausing tool."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdiag.capture.discover import multiprocessing_helper
from kvdiag.capture.orchestrate import capture_processes
from kvdiag.osread.net import TcpEntry, process_tcp

pytestmark = pytest.mark.timeout(60)   # bounds the reads of the children's output


def test_the_tcp_tables_of_one_namespace_are_read_once_and_give_the_same_sockets() -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        alone = process_tcp(os.getpid())
        shared: dict[str, tuple[list[TcpEntry], list[str]]] = {}
        first = process_tcp(os.getpid(), shared=shared)
        assert alone is not None and first is not None and list(shared) == [first.netns]
        shared[first.netns or ""][0].clear()   # a second read through the cache sees the cached (now empty) table
        again = process_tcp(os.getpid(), shared=shared)
        assert again is not None and again.sockets == [] and again.addresses == first.addresses
        assert {s.entry.local for s in first.sockets} == {s.entry.local for s in alone.sockets}
        assert any(s.fd == srv.fileno() for s in first.sockets)
    finally:
        srv.close()


def test_multiprocessing_resource_tracker_is_a_helper_and_a_plain_python_process_is_not() -> None:
    # A fresh interpreter starts its real tracker, says its pid and waits (bounded) until told to go.
    code = ("import sys, time\nfrom multiprocessing import resource_tracker as rt\nrt.ensure_running()\n"
            "print(rt._resource_tracker._pid, flush=True)\nsys.stdin.readline()\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert owner.stdout is not None
        tracker = int(owner.stdout.readline())
        assert multiprocessing_helper(tracker)
        assert not multiprocessing_helper(owner.pid) and not multiprocessing_helper(os.getpid())
        assert not multiprocessing_helper(2 ** 22 + 12345)   # no such process
    finally:
        owner.kill()   # the tracker ends when its last user's pipe closes
        owner.wait(timeout=10)


def test_what_runs_beside_starts_inside_the_window_not_before_it(tmp_path: Path) -> None:
    # A real sleeping process, /proc only: on_open is called once, after its window opened and before it closed.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        time.sleep(0.2)
        calls: list[float] = []
        start = time.monotonic()
        evidence, _ = capture_processes([proc.pid], tmp_path, timeout_s=5.0, backends=["proc"],
                                        on_open=lambda: calls.append(time.monotonic() - start))
        [run] = [t for t in evidence[0].tools if t.tool == "proc"]
        assert run.ok and run.started_s is not None and len(calls) == 1
        assert evidence[0].progress is not None and evidence[0].progress.window_s >= 0.3
        assert run.started_s <= calls[0] < run.started_s + run.duration_s - 0.2
    finally:
        proc.kill()
        proc.wait(timeout=10)
