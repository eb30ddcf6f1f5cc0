"""kvcached's live state on this host: memory-info segments in /dev/shm and worker IPC sockets.

Read-only: segments are read without taking their lock (a snapshot may be
torn; it is only shown), sockets are looked up, never connected to.

- A segment is kvcached's MemInfoStruct: three int64 (total, used, prealloc
  bytes), 24 bytes, at /dev/shm/<ipc name>. The processes holding it are found
  through /proc/<pid>/maps and fd links.
- A worker socket is /tmp/kvcached-tp-<name>-<hash>/[pp<k>/]w<rank>.sock. The
  listener is the worker process; the peers are engines with a call in
  flight. Peers are found with the kernel's sock_diag netlink interface
  (UNIX_DIAG_PEER), which names the other end of every connected socket.
"""

from __future__ import annotations

import os
import re
import socket
import struct
from pathlib import Path

from kvdiag.model import IpcSocket, KvcachedRuntime, ShmSegment

SEGMENT_SIZE = 24
SOCKET_GLOB = "kvcached-tp-*"

# netlink / sock_diag constants (linux/netlink.h, linux/sock_diag.h, linux/unix_diag.h)
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_UDIAG_SHOW_NAME, _UDIAG_SHOW_PEER = 0x1, 0x4
_UNIX_DIAG_NAME, _UNIX_DIAG_PEER = 0, 2
_TCP_LISTEN = 10


def _read_segment(path: Path) -> tuple[int, int, int] | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) != SEGMENT_SIZE:
        return None
    total, used, prealloc = struct.unpack("<qqq", data)
    if total < 0 or used < 0 or prealloc < 0:
        return None
    return total, used, prealloc


def _pids() -> list[int]:
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


def _fd_targets(pid: int) -> list[str]:
    out: list[str] = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def _maps_paths(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
            return {line.split(None, 5)[5].strip() for line in fh if line.count(" ") >= 5 and "/dev/shm/" in line}
    except (OSError, IndexError):
        return set()


def _unix_diag() -> dict[int, tuple[str | None, int | None, int]] | None:
    """inode -> (bound path, peer inode, state) for every unix socket, or None without sock_diag."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
    except (OSError, AttributeError):
        return None
    out: dict[int, tuple[str | None, int | None, int]] = {}
    try:
        sock.settimeout(2.0)
        req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0,
                          _UDIAG_SHOW_NAME | _UDIAG_SHOW_PEER, 0xFFFFFFFF, 0xFFFFFFFF)
        hdr = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
        sock.sendto(hdr + req, (0, 0))
        done = False
        while not done:
            data = sock.recv(1 << 16)
            off = 0
            while off + 16 <= len(data):
                length, mtype, _flags, _seq, _pid = struct.unpack_from("=IHHII", data, off)
                if length < 16:
                    done = True
                    break
                if mtype == _NLMSG_DONE or mtype == _NLMSG_ERROR:
                    done = True
                    break
                body = data[off + 16:off + length]
                if len(body) >= 16:
                    _fam, _typ, state, _pad, ino = struct.unpack_from("=BBBBI", body, 0)
                    name: str | None = None
                    peer: int | None = None
                    a = 16
                    while a + 4 <= len(body):
                        alen, atype = struct.unpack_from("=HH", body, a)
                        if alen < 4:
                            break
                        payload = body[a + 4:a + alen]
                        if atype == _UNIX_DIAG_NAME and payload:
                            name = payload.split(b"\0", 1)[0].decode(errors="replace") if payload[0] else None
                        elif atype == _UNIX_DIAG_PEER and len(payload) >= 4:
                            peer = struct.unpack_from("=I", payload)[0]
                        a += (alen + 3) & ~3
                    out[ino] = (name, peer, state)
                off += (length + 3) & ~3
    except OSError:
        return None if not out else out
    finally:
        sock.close()
    return out


def _proc_net_unix() -> dict[int, tuple[str | None, int | None, int]]:
    """Fallback without sock_diag: /proc/net/unix gives paths and states, not peers."""
    out: dict[int, tuple[str | None, int | None, int]] = {}
    try:
        lines = Path("/proc/net/unix").read_text(encoding="utf-8").splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) < 7:
            continue
        try:
            ino = int(parts[6])
            flags = int(parts[3], 16)
        except ValueError:
            continue
        path = parts[7] if len(parts) > 7 else None
        out[ino] = (path, None, _TCP_LISTEN if flags & 0x10000 else 1)
    return out


def collect_runtime(shm_dir: Path = Path("/dev/shm"), tmp_dir: Path = Path("/tmp"),
                    segment_prefixes: tuple[str, ...] | None = None) -> KvcachedRuntime | None:
    """Segments and sockets found now, with the processes at each end; None when there are none."""
    rt = KvcachedRuntime()
    seg_paths: list[Path] = []
    try:
        entries = sorted(shm_dir.iterdir())
    except OSError:
        entries = []
    for p in entries:
        if segment_prefixes is not None and not p.name.startswith(segment_prefixes):
            continue
        try:
            if not p.is_file() or p.stat().st_size != SEGMENT_SIZE:
                continue
        except OSError:
            continue
        vals = _read_segment(p)
        if vals is None:
            continue
        seg_paths.append(p)
        rt.segments.append(ShmSegment(name=p.name, total_bytes=vals[0], used_bytes=vals[1], prealloc_bytes=vals[2]))
    sock_paths = sorted(str(p) for d in tmp_dir.glob(SOCKET_GLOB) for p in d.rglob("*.sock"))
    if not rt.segments and not sock_paths:
        return None

    diag = _unix_diag()
    if diag is None:
        diag = _proc_net_unix()
        rt.notes.append("sock_diag unavailable: socket peers not resolved (listeners from /proc/net/unix)")
    inode_pids: dict[int, set[int]] = {}
    seg_pids: dict[str, set[int]] = {str(p): set() for p in seg_paths}
    unreadable = 0
    for pid in _pids():
        targets = _fd_targets(pid)
        if not targets and not os.access(f"/proc/{pid}/fd", os.R_OK):
            unreadable += 1
        for t in targets:
            m = re.fullmatch(r"socket:\[(\d+)\]", t)
            if m:
                inode_pids.setdefault(int(m.group(1)), set()).add(pid)
            elif t in seg_pids:
                seg_pids[t].add(pid)
        if seg_pids:
            for path in _maps_paths(pid):
                if path in seg_pids:
                    seg_pids[path].add(pid)
    for seg, seg_path in zip(rt.segments, seg_paths, strict=True):
        seg.pids = sorted(seg_pids[str(seg_path)])
    if unreadable:
        rt.notes.append(f"{unreadable} process(es) not readable by this user: their ends are not shown")

    for path in sock_paths:
        entry = IpcSocket(path=path)
        listeners: set[int] = set()
        servers: set[int] = set()   # accepted connections carry the bound path too
        peers: set[int] = set()
        for ino, (name, peer, state) in diag.items():
            if name != path:
                continue
            owners = inode_pids.get(ino, set())
            if state == _TCP_LISTEN:
                listeners |= owners
            else:
                servers |= owners
                if peer:
                    peers |= inode_pids.get(peer, set())
        entry.listener_pids = sorted(listeners | servers)
        entry.peer_pids = sorted(peers - listeners - servers) or sorted(peers)
        entry.stale = not listeners
        rt.sockets.append(entry)
    return rt
