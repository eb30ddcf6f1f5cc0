"""The reading layer on this process and on real sockets: typed records, None for what is gone."""

from __future__ import annotations

import os
import socket
import threading

from kvdiag.osread.fds import fd_links, held_inodes, inode_holders, link_inode
from kvdiag.osread.maps import parse_line, parse_maps_line, read_maps
from kvdiag.osread.net import (
    listening_pids,
    listening_ports,
    process_tcp,
    tcp_connections,
    tcp_table,
    unix_table,
)
from kvdiag.osread.process import read_cmdline, read_comm, read_environ
from kvdiag.osread.ptable import alive, ancestors, process_tree
from kvdiag.osread.sockdiag import unix_sockets
from kvdiag.osread.stat import parse_stat, read_stat
from kvdiag.osread.status import parse_status, read_status
from kvdiag.osread.syscall import futex_wait_of, int_timeout, parse_syscall, syscalls_of
from kvdiag.osread.tasks import list_tids, read_task, snapshot

GONE = 2 ** 22 + 12345     # above pid_max's default: no such process


def test_stat_parses_past_a_comm_with_spaces_and_parentheses() -> None:
    line = "42 (a (weird) name) S 1 42 42 0 -1 4194560 1 0 0 0 7 3 0 0 20 0 3 0"
    st = parse_stat(line, 42)
    assert st is not None and st.state == "S" and st.ppid == 1 and st.pgid == 42
    assert (st.utime, st.stime, st.ticks) == (7, 3, 10) and not st.kernel_thread
    assert parse_stat("42 (short) S 1", 42) is None


def test_status_fields_are_typed() -> None:
    text = ("State:\tS (sleeping)\nPPid:\t7\nTracerPid:\t0\nUid:\t1000\t1000\t1000\t1000\nSigCgt:\t0000000000004002\n"
            "CapEff:\t0000000000080000\nSeccomp:\t2\nvoluntary_ctxt_switches:\t5\nnonvoluntary_ctxt_switches:\t2\n")
    st = parse_status(text)
    assert (st.state, st.ppid, st.tracer_pid, st.uid, st.seccomp, st.ctx_switches) == ("S", 7, 0, 1000, 2, 7)
    assert st.sig_caught == 0x4002 and st.cap_eff is not None and st.cap_eff >> 19 & 1
    assert parse_status("").state == "?"


def test_this_process_reads_back() -> None:
    me = os.getpid()
    st, status = read_stat(me), read_status(me)
    assert st is not None and st.pid == me and status is not None and status.uid == os.getuid()
    assert alive(me) and me in process_tree(os.getppid()) and os.getppid() in ancestors(me)
    assert read_comm(me) and read_cmdline(me) and (read_environ(me) or {}).get("PATH") == os.environ.get("PATH")
    assert me in list_tids(me) and me in snapshot(me)
    task = read_task(me, me)
    assert task is not None and task.ticks is not None


def test_a_process_that_is_gone_reads_as_none() -> None:
    assert read_stat(GONE) is None and read_status(GONE) is None and read_task(GONE, GONE) is None
    assert not alive(GONE) and process_tree(GONE) == [] and fd_links(GONE) is None and read_maps(GONE) is None
    assert list_tids(GONE) == [] and read_comm(GONE) is None


def test_syscall_lines() -> None:
    futex = syscalls_of("x86_64")["futex"]
    assert 202 in futex and 98 in syscalls_of("aarch64")["futex"]
    assert parse_syscall("202 0x7f00 0x80 0x0 0x0 0x0 0x0 0x7ffd 0x7f") == (202, [0x7F00, 0x80, 0, 0, 0, 0])
    assert parse_syscall("running") == (None, []) and parse_syscall("-1 0x7ffd 0x7f")[0] == -1
    assert int_timeout(0xFFFFFFFF) == -1 and int_timeout(5000) == 5000
    if 202 in syscalls_of(os.uname().machine).get("futex", ()):
        assert futex_wait_of("202 0x7f00 0x80 0x0") == (0x7F00, 0)


def test_maps_lines() -> None:
    shared = parse_maps_line("7f1c2d000000-7f1c2d001000 rw-s 00000000 00:1b 1558    /dev/shm/ring\n")
    assert shared is not None and shared.inode == 1558 and shared.path == "/dev/shm/ring"
    private = parse_line("55d0c0000000-55d0c0021000 r-xp 00001000 08:01 77 /usr/bin/python3.11\n")
    assert private is not None and not private.shared and private.offset == 0x1000
    assert parse_maps_line("55d0c0000000-55d0c0021000 r-xp 00001000 08:01 77 /usr/bin/python3.11\n") is None


def test_sockets_are_found_with_their_peer_and_holder() -> None:
    a, b = socket.socketpair()
    try:
        ia, ib = os.fstat(a.fileno()).st_ino, os.fstat(b.fileno()).st_ino
        assert link_inode(os.readlink(f"/proc/self/fd/{a.fileno()}")) == ("socket", ia)
        assert {ia, ib} <= held_inodes(os.getpid(), "socket")
        dump = unix_sockets()
        if not dump.unavailable:
            assert dump.peers().get(ia) == ib and dump.peers().get(ib) == ia
        assert ia in unix_table()
        holders, partial = inode_holders({ia}, skip_pid=-1)
        assert partial is None and holders.get(ia) == [os.getpid()]
    finally:
        a.close()
        b.close()


def test_who_listens_on_a_port() -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        srv.bind(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        assert os.getpid() not in listening_pids(port)      # bound, not listening
        srv.listen(1)
        assert os.getpid() in listening_pids(port) and port in listening_ports([os.getpid()])
        entry = next(e for e in tcp_table() if e.local_port == port)
        assert entry.listening and entry.local == f"127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            here = client.getsockname()[1]
            assert f"127.0.0.1:{here} -> 127.0.0.1:{port}" in (tcp_connections(os.getpid()) or [])
        assert tcp_connections(GONE) is None
    finally:
        srv.close()


def test_every_tcp_socket_of_a_process_with_its_fd_and_the_connections_queued_on_its_listener() -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            here = client.getsockname()[1]
            tcp = process_tcp(os.getpid())
            assert tcp is not None and tcp.netns == os.readlink("/proc/self/ns/net")
            assert "127.0.0.1" in tcp.addresses
            by = {(s.entry.local, s.entry.remote): s for s in tcp.sockets}
            assert by[(f"127.0.0.1:{port}", "0.0.0.0:0")].state == "listen"
            assert by[(f"127.0.0.1:{port}", "0.0.0.0:0")].fd == srv.fileno()
            assert by[(f"127.0.0.1:{here}", f"127.0.0.1:{port}")].fd == client.fileno()
            # not accepted yet: held by no fd, queued on our listener
            queued = by[(f"127.0.0.1:{port}", f"127.0.0.1:{here}")]
            assert queued.fd is None and queued.state == "established"
        assert process_tcp(GONE) is None
    finally:
        srv.close()


def test_a_thread_blocked_in_a_read_shows_its_syscall() -> None:
    r, w = os.pipe()
    ready = threading.Event()
    tid: list[int] = []

    def reader() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        os.read(r, 1)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        assert ready.wait(5)
        reads = syscalls_of(os.uname().machine).get("read", frozenset())
        for _ in range(200):        # bounded: the thread enters read(2) right after it signals
            task = read_task(os.getpid(), tid[0])
            nr, args = parse_syscall(task.syscall if task else None)
            if nr in reads:
                assert args[0] == r
                break
            threading.Event().wait(0.01)
        else:
            raise AssertionError("the reader never showed read(2) in /proc")
    finally:
        os.write(w, b"x")
        t.join(5)
        os.close(r)
        os.close(w)
