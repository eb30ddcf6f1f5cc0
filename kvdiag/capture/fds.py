"""What a blocked thread's file descriptor is connected to: pipe or socket, and the process at the other end.

Read-only and stop-free: ``/proc/PID/fd`` links, ``/proc/PID/fdinfo`` (epoll
registrations), ``/proc/net/{unix,tcp,tcp6}`` and, for Unix sockets, one
NETLINK_SOCK_DIAG query for the peer inode (the only place Linux publishes it).
A peer is named by scanning ``/proc/*/fd`` once for the inodes wanted.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field

from kvdiag.model.evidence import FdInfo
from kvdiag.osread.fds import fd_stat, held_inodes, inode_holders, link_inode, readlink, scan_holders
from kvdiag.osread.files import PROC
from kvdiag.osread.net import TCP_LISTEN_HEX, TcpEntry, UnixNetEntry, tcp_table, unix_table
from kvdiag.osread.process import read_comm
from kvdiag.osread.sockdiag import unix_sockets


@dataclass
class _SocketTable:
    """Unix and TCP sockets of the host, by inode (read once per capture)."""

    unix: dict[int, UnixNetEntry] = field(default_factory=dict)
    tcp: dict[int, TcpEntry] = field(default_factory=dict)
    unix_peer: dict[int, int] = field(default_factory=dict)               # inode -> peer inode
    unix_peer_partial: str | None = None                                    # why unix_peer may lack entries
    loaded: bool = False

    def load(self, deadline: float | None, pid: int) -> None:
        self.unix = unix_table()
        # The target's own network namespace: kvdiag may run outside it (a pod's process seen from its node).
        self.tcp = {e.inode: e for e in tcp_table(f"{PROC}/{pid}")}
        dump = unix_sockets(deadline)
        self.unix_peer, self.unix_peer_partial = dump.peers(), dump.partial
        self.loaded = True


def is_fifo(info: FdInfo) -> bool:
    """A named pipe: a pipe whose fd links to a path, not to ``pipe:[inode]``."""
    return info.kind == "pipe" and info.target.startswith("/")


def pipe_link(info: FdInfo) -> str:
    """What another process's fd links to when it holds the same pipe."""
    return info.target if is_fifo(info) else f"pipe:[{info.inode}]"


class FdResolver:
    """Describes fds of one target; host-wide tables are read lazily, once."""

    def __init__(self, pid: int, deadline: float | None = None) -> None:
        self.pid = pid
        self.deadline = deadline        # monotonic; host-wide lookups stop there and say "partial"
        self._table = _SocketTable()

    def describe(self, fds: list[int]) -> list[FdInfo]:
        infos = [i for fd in fds if (i := self._basic(fd)) is not None]
        if any(i.kind == "socket" for i in infos) and not self._table.loaded:
            self._table.load(self.deadline, self.pid)
        wanted: set[int] = set()
        fifos = {i.target for i in infos if is_fifo(i)}
        fifo_scan = scan_holders(fifos, self.deadline, modes=False) if fifos else None
        for info in infos:
            if fifo_scan is not None and is_fifo(info):
                info.peer_pids = sorted({h.pid for h in fifo_scan.by_link.get(info.target, []) if h.pid != self.pid})
                info.partial = fifo_scan.partial
                if info.peer_pids:
                    info.peer_comm = read_comm(info.peer_pids[0]) or None
            elif info.kind == "socket" and info.inode is not None:
                self._socket(info)
                if info.peer_inode is not None:
                    wanted.add(info.peer_inode)
            elif info.kind == "pipe" and info.inode is not None:
                wanted.add(info.inode)
        owners, scan_partial = inode_holders(wanted, self.pid, self.deadline)
        own = held_inodes(self.pid)
        for info in infos:
            if info.kind == "socket" and info.proto == "unix" and info.peer_inode is None:
                info.partial = self._table.unix_peer_partial
            key = info.peer_inode if info.kind == "socket" else info.inode
            if key is None or is_fifo(info):
                continue
            info.partial = info.partial or scan_partial
            info.peer_pids = owners.get(key, [])
            if info.kind == "socket" and not info.peer_pids and key in own:
                info.peer_pids = [self.pid]          # both ends inside the target (a socketpair)
            if info.peer_pids:
                info.peer_comm = read_comm(info.peer_pids[0]) or None
        return infos

    def as_mqueue(self, info: FdInfo) -> None:
        """``info`` is a POSIX message queue (a thread waits in mq_timedreceive on it): the other processes
        holding the same queue (by identity: its name may be unlinked), and those that may send on it."""
        st = fd_stat(self.pid, info.fd)
        info.kind = "mqueue"
        if st is None:
            return
        info.inode = st.st_ino
        scan = scan_holders({info.target}, self.deadline)
        same = [h for h in scan.by_link.get(info.target, []) if h.pid != self.pid
                and (s := fd_stat(h.pid, h.fd)) is not None and (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino)]
        info.peer_pids = sorted({h.pid for h in same})
        info.writer_pids = sorted({h.pid for h in same if "w" in h.mode or not h.mode})
        info.partial = scan.partial
        if info.peer_pids:
            info.peer_comm = read_comm(info.peer_pids[0]) or None

    def _basic(self, fd: int) -> FdInfo | None:
        link = readlink(self.pid, fd)
        if link is None:
            return None
        found = link_inode(link)
        if found is not None:
            return FdInfo(fd=fd, kind=found[0], target=link, inode=found[1])
        if link.startswith("anon_inode:"):
            return FdInfo(fd=fd, kind="anon", target=link)
        if link.startswith("/"):
            st = fd_stat(self.pid, fd)
            if st is not None and stat.S_ISFIFO(st.st_mode):
                # A named pipe is a pipe whose ends are reached by its path: held by whoever opened that path.
                return FdInfo(fd=fd, kind="pipe", target=link, inode=st.st_ino, address=link)
            return FdInfo(fd=fd, kind="file", target=link, address=link)
        return FdInfo(fd=fd, kind="other", target=link)

    def _socket(self, info: FdInfo) -> None:
        assert info.inode is not None
        unix = self._table.unix.get(info.inode)
        if unix is not None:
            info.proto, info.listening, info.address = "unix", unix.listening, unix.path or None
            # /proc/net/unix shows the listener's path on accepted sockets, none on the client end
            info.accepted = not unix.listening and bool(unix.path)
            info.peer_inode = self._table.unix_peer.get(info.inode)
            return
        tcp = self._table.tcp.get(info.inode)
        if tcp is not None:
            info.proto, info.listening = tcp.proto, tcp.listening
            info.address = tcp.local if tcp.listening else f"{tcp.local} -> {tcp.remote}"
            if not tcp.listening:
                info.peer_inode = next((e.inode for e in self._table.tcp.values()
                                        if e.proto == tcp.proto and e.local == tcp.remote and e.remote == tcp.local),
                                       None)
                ip, _, port = tcp.local.rpartition(":")
                info.accepted = any(e.state == TCP_LISTEN_HEX and e.proto == tcp.proto
                                    and e.local.rpartition(":")[2] == port
                                    and e.local.rpartition(":")[0] in (ip, "0.0.0.0", "::")
                                    for e in self._table.tcp.values())
