"""The kernel's NETLINK_SOCK_DIAG interface for Unix sockets: every socket's bound path, state and peer.

The peer inode (UNIX_DIAG_PEER) is published nowhere else: /proc/net/unix shows paths and states only.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass, field

# linux/netlink.h, linux/sock_diag.h, linux/unix_diag.h
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_UDIAG_SHOW_NAME, _UDIAG_SHOW_PEER = 0x1, 0x4
_UNIX_DIAG_NAME, _UNIX_DIAG_PEER = 0, 2
DEFAULT_TIMEOUT_S = 5.0
TCP_LISTEN = 10           # a listening Unix socket's state (the kernel reuses TCP_LISTEN)


@dataclass(frozen=True)
class UnixSocketDiag:
    inode: int
    path: str | None          # bound path; None for unbound and abstract sockets
    peer: int | None          # the peer socket's inode (connected sockets)
    state: int                # TCP_LISTEN for a listener; 1 (established) or 7 (unconnected) otherwise


@dataclass(frozen=True)
class UnixDiagDump:
    """Every Unix socket of the host by inode, and why the dump may be incomplete (None: complete)."""

    sockets: dict[int, UnixSocketDiag] = field(default_factory=dict)
    partial: str | None = None
    unavailable: bool = False     # no netlink socket could be opened (the dump is empty)

    def peers(self) -> dict[int, int]:
        """inode -> peer inode of every connected socket."""
        return {ino: s.peer for ino, s in self.sockets.items() if s.peer is not None}


def _parse_message(data: bytes, off: int, length: int) -> UnixSocketDiag:
    body = off + 16
    # unix_diag_msg: family, type, state, pad, ino, cookie[2]
    state, ino = data[body + 2], struct.unpack_from("=I", data, body + 4)[0]
    path: str | None = None
    peer: int | None = None
    attr = body + 16
    while attr + 4 <= off + length:
        alen, atype = struct.unpack_from("=HH", data, attr)
        if alen < 4:
            break
        payload = data[attr + 4:attr + alen]
        if atype == _UNIX_DIAG_NAME and payload and payload[0]:
            path = payload.split(b"\0", 1)[0].decode(errors="replace")
        elif atype == _UNIX_DIAG_PEER and len(payload) >= 4:
            peer = struct.unpack_from("=I", payload)[0]
        attr += (alen + 3) & ~3
    return UnixSocketDiag(ino, path, peer, state)


def unix_sockets(deadline: float | None = None) -> UnixDiagDump:
    """One sock_diag dump of all Unix sockets, read until NLMSG_DONE. Each wait is bounded by ``deadline``
    (monotonic; default 5 s from now); a dump the deadline cut, or that netlink refused, says so in
    ``partial`` instead of passing as complete."""
    end = deadline if deadline is not None else time.monotonic() + DEFAULT_TIMEOUT_S
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
    except (OSError, AttributeError) as exc:
        return UnixDiagDump(partial=f"sock_diag unavailable ({exc})", unavailable=True)
    out: dict[int, UnixSocketDiag] = {}

    def cut(why: str) -> UnixDiagDump:
        return UnixDiagDump(out, why)

    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        # unix_diag_req: family, protocol, pad, states, ino, show, cookie[2]
        req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, _UDIAG_SHOW_NAME | _UDIAG_SHOW_PEER,
                          0xFFFFFFFF, 0xFFFFFFFF)
        hdr = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
        sock.send(hdr + req)
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return cut(f"sock_diag dump cut by the capture deadline after {len(out)} sockets")
            sock.settimeout(left)
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                return cut(f"sock_diag dump cut by the capture deadline after {len(out)} sockets")
            if not data:
                return cut("sock_diag closed before NLMSG_DONE")
            off = 0
            while off + 16 <= len(data):
                length, mtype = struct.unpack_from("=IH", data, off)
                if length < 16:
                    return cut("malformed sock_diag reply")
                if mtype == _NLMSG_DONE:
                    return UnixDiagDump(out)
                if mtype == _NLMSG_ERROR:
                    err = -struct.unpack_from("=i", data, off + 16)[0] if length >= 20 else 0
                    return cut(f"sock_diag error {os.strerror(err) if err else 'unknown'}")
                if length >= 32:
                    found = _parse_message(data, off, length)
                    out[found.inode] = found
                off += (length + 3) & ~3
    except OSError as exc:
        return cut(f"sock_diag failed after {len(out)} sockets ({exc})")
    finally:
        sock.close()
