"""What a blocked thread's file descriptor is connected to: pipe or socket, and the process at the other end.

Read-only and stop-free: ``/proc/PID/fd`` links, ``/proc/PID/fdinfo`` (epoll
registrations), ``/proc/net/{unix,tcp,tcp6}`` and, for Unix sockets, one
NETLINK_SOCK_DIAG query for the peer inode (the only place Linux publishes it).
A peer is named by scanning ``/proc/*/fd`` once for the inodes wanted.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import time
from dataclasses import dataclass, field

from kvdiag.model import FdInfo

_LINK = re.compile(r"^(socket|pipe):\[(\d+)\]$")
_TFD = re.compile(r"^tfd:\s*(\d+)\s+events:\s*([0-9a-fA-F]+)", re.MULTILINE)
_UNIX_LISTEN_FLAG = 0x00010000       # __SO_ACCEPTCON in /proc/net/unix "Flags"
_TCP_LISTEN = "0A"
# NETLINK_SOCK_DIAG / unix_diag (linux/unix_diag.h)
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_UDIAG_SHOW_PEER = 0x00000004
_UNIX_DIAG_PEER = 2
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_NLM_F_REQUEST = 1
_NLM_F_DUMP = 0x300
_NETLINK_DEFAULT_S = 5.0


def readlink(pid: int, fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None


def epoll_targets(pid: int, epfd: int) -> list[int]:
    """The fds registered in epoll instance ``epfd`` of ``pid`` (from fdinfo)."""
    try:
        with open(f"/proc/{pid}/fdinfo/{epfd}", encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return []
    return [int(m.group(1)) for m in _TFD.finditer(text)]


@dataclass
class _SocketTable:
    """Unix and TCP sockets of the host, by inode (read once per capture)."""

    unix: dict[int, tuple[bool, str]] = field(default_factory=dict)        # inode -> (listening, path)
    tcp: dict[int, tuple[str, str, str, str]] = field(default_factory=dict)  # inode -> (proto, local, remote, st)
    unix_peer: dict[int, int] = field(default_factory=dict)               # inode -> peer inode
    unix_peer_partial: str | None = None                                    # why unix_peer may lack entries
    loaded: bool = False


def _hexaddr(text: str) -> str:
    addr, port = text.split(":")
    if len(addr) == 8:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(addr, 16)))
    else:
        raw = bytes.fromhex(addr)
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


def _load_net(table: _SocketTable, deadline: float | None = None) -> None:
    try:
        with open("/proc/net/unix", encoding="utf-8") as fh:
            next(fh, None)
            for line in fh:
                parts = line.split()
                if len(parts) >= 7 and parts[6].isdigit():
                    table.unix[int(parts[6])] = (bool(int(parts[3], 16) & _UNIX_LISTEN_FLAG),
                                                 parts[7] if len(parts) > 7 else "")
    except OSError:
        pass
    for proto in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{proto}", encoding="utf-8") as fh:
                next(fh, None)
                for line in fh:
                    parts = line.split()
                    if len(parts) >= 10 and parts[9].isdigit():
                        try:
                            table.tcp[int(parts[9])] = (proto, _hexaddr(parts[1]), _hexaddr(parts[2]), parts[3])
                        except (ValueError, OSError):
                            continue
        except OSError:
            pass
    table.unix_peer, table.unix_peer_partial = unix_peers(deadline)
    table.loaded = True


def unix_peers(deadline: float | None = None) -> tuple[dict[int, int], str | None]:
    """inode -> peer inode of every connected Unix socket (one sock_diag dump), and why it is partial (None:
    complete). Every reply is read until NLMSG_DONE, each wait bounded by ``deadline`` (monotonic; default
    5 s from now); a dump the deadline cut, or that netlink refused, says so instead of passing as complete."""
    end = deadline if deadline is not None else time.monotonic() + _NETLINK_DEFAULT_S
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
    except (OSError, AttributeError) as exc:
        return {}, f"sock_diag unavailable ({exc})"
    out: dict[int, int] = {}
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        # unix_diag_req: family, protocol, pad, states, ino, show, cookie[2]
        req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, _UDIAG_SHOW_PEER, 0xFFFFFFFF,
                          0xFFFFFFFF)
        hdr = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
        sock.send(hdr + req)
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return out, f"sock_diag dump cut by the capture deadline after {len(out)} sockets"
            sock.settimeout(left)
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                return out, f"sock_diag dump cut by the capture deadline after {len(out)} sockets"
            if not data:
                return out, "sock_diag closed before NLMSG_DONE"
            off = 0
            while off + 16 <= len(data):
                length, mtype = struct.unpack_from("=IH", data, off)
                if length < 16:
                    return out, "malformed sock_diag reply"
                if mtype == _NLMSG_DONE:
                    return out, None
                if mtype == _NLMSG_ERROR:
                    err = -struct.unpack_from("=i", data, off + 16)[0] if length >= 20 else 0
                    return out, f"sock_diag error {os.strerror(err) if err else 'unknown'}"
                body = off + 16
                # unix_diag_msg: family, type, state, pad, ino, cookie[2]
                ino = struct.unpack_from("=I", data, body + 4)[0]
                attr = body + 16
                while attr + 4 <= off + length:
                    alen, atype = struct.unpack_from("=HH", data, attr)
                    if alen < 4:
                        break
                    if atype == _UNIX_DIAG_PEER and alen >= 8:
                        out[ino] = struct.unpack_from("=I", data, attr + 4)[0]
                    attr += (alen + 3) & ~3
                off += (length + 3) & ~3
    except OSError as exc:
        return out, f"sock_diag failed after {len(out)} sockets ({exc})"
    finally:
        sock.close()


def _owners(inodes: set[int], skip_pid: int, deadline: float | None = None) -> tuple[dict[int, list[int]], str | None]:
    """inode -> pids (other than ``skip_pid``) holding a socket or pipe with that inode, and why the scan is
    partial (None: every readable process was scanned).

    Every pid of the host, each fd read once (a readlink per fd; a process whose fd folder may not be read
    costs one failed open). The scan stops early only at ``deadline``, and says so: any process may hold
    any end (fork, SCM_RIGHTS), so no subset of pids can be skipped without losing a holder.
    """
    out: dict[int, list[int]] = {}
    if not inodes:
        return out, None
    try:
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    except OSError as exc:
        return out, f"/proc unreadable ({exc})"
    wanted = {f"socket:[{i}]" for i in inodes} | {f"pipe:[{i}]" for i in inodes}
    for n, pid in enumerate(pids):
        if deadline is not None and n % 64 == 0 and time.monotonic() > deadline:
            return out, f"fd scan cut by the capture deadline after {n} of {len(pids)} processes"
        if pid == skip_pid:
            continue
        base = f"/proc/{pid}/fd/"
        try:
            fds = os.listdir(base)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(base + fd)
            except OSError:
                continue
            if link in wanted:
                lst = out.setdefault(int(link[link.index("[") + 1:-1]), [])
                if pid not in lst:
                    lst.append(pid)
    return out, None


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


class FdResolver:
    """Describes fds of one target; host-wide tables are read lazily, once."""

    def __init__(self, pid: int, deadline: float | None = None) -> None:
        self.pid = pid
        self.deadline = deadline        # monotonic; host-wide lookups stop there and say "partial"
        self._table = _SocketTable()

    def describe(self, fds: list[int]) -> list[FdInfo]:
        infos = [i for fd in fds if (i := self._basic(fd)) is not None]
        if any(i.kind == "socket" for i in infos) and not self._table.loaded:
            _load_net(self._table, self.deadline)
        wanted: set[int] = set()
        for info in infos:
            if info.kind == "socket" and info.inode is not None:
                self._socket(info)
                if info.peer_inode is not None:
                    wanted.add(info.peer_inode)
            elif info.kind == "pipe" and info.inode is not None:
                wanted.add(info.inode)
        owners, scan_partial = _owners(wanted, self.pid, self.deadline)
        own = self._own_inodes()
        for info in infos:
            if info.kind == "socket" and info.proto == "unix" and info.peer_inode is None:
                info.partial = self._table.unix_peer_partial
            key = info.peer_inode if info.kind == "socket" else info.inode
            if key is None:
                continue
            info.partial = info.partial or scan_partial
            info.peer_pids = owners.get(key, [])
            if info.kind == "socket" and not info.peer_pids and key in own:
                info.peer_pids = [self.pid]          # both ends inside the target (a socketpair)
            if info.peer_pids:
                info.peer_comm = _comm(info.peer_pids[0])
        return infos

    def _own_inodes(self) -> set[int]:
        out: set[int] = set()
        try:
            for fd in os.listdir(f"/proc/{self.pid}/fd"):
                m = _LINK.match(readlink(self.pid, int(fd)) or "") if fd.isdigit() else None
                if m:
                    out.add(int(m.group(2)))
        except OSError:
            pass
        return out

    def _basic(self, fd: int) -> FdInfo | None:
        link = readlink(self.pid, fd)
        if link is None:
            return None
        m = _LINK.match(link)
        if m:
            kind = "socket" if m.group(1) == "socket" else "pipe"
            return FdInfo(fd=fd, kind=kind, target=link, inode=int(m.group(2)))
        if link.startswith("anon_inode:"):
            return FdInfo(fd=fd, kind="anon", target=link)
        if link.startswith("/"):
            return FdInfo(fd=fd, kind="file", target=link, address=link)
        return FdInfo(fd=fd, kind="other", target=link)

    def _socket(self, info: FdInfo) -> None:
        assert info.inode is not None
        if info.inode in self._table.unix:
            listening, path = self._table.unix[info.inode]
            info.proto, info.listening, info.address = "unix", listening, path or None
            # /proc/net/unix shows the listener's path on accepted sockets, none on the client end
            info.accepted = not listening and bool(path)
            info.peer_inode = self._table.unix_peer.get(info.inode)
            return
        if info.inode in self._table.tcp:
            proto, local, remote, st = self._table.tcp[info.inode]
            info.proto, info.listening = proto, st == _TCP_LISTEN
            info.address = local if info.listening else f"{local} -> {remote}"
            if not info.listening:
                peer = next((ino for ino, (p, loc, rem, _) in self._table.tcp.items()
                             if p == proto and loc == remote and rem == local), None)
                info.peer_inode = peer
                ip, _, port = local.rpartition(":")
                info.accepted = any(st2 == _TCP_LISTEN and p2 == proto and loc2.rpartition(":")[2] == port and
                                    loc2.rpartition(":")[0] in (ip, "0.0.0.0", "::")
                                    for p2, loc2, _r, st2 in self._table.tcp.values())

