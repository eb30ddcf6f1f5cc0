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

import struct
from pathlib import Path

from kvdiag.model.environment import IpcSocket, KvcachedRuntime, ShmSegment
from kvdiag.osread.fds import fd_links, link_inode
from kvdiag.osread.maps import read_maps
from kvdiag.osread.net import unix_table
from kvdiag.osread.sockdiag import TCP_LISTEN, UnixSocketDiag, unix_sockets
from kvdiag.osread.stat import all_pids

SEGMENT_SIZE = 24
SOCKET_GLOB = "kvcached-tp-*"


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


def _maps_paths(pid: int) -> set[str]:
    return {m.path for m in read_maps(pid) or [] if "/dev/shm/" in m.path}


def _unix_sockets() -> tuple[dict[int, UnixSocketDiag], str | None]:
    """inode -> (bound path, peer inode, state) of every Unix socket, and a note when peers are unknown."""
    dump = unix_sockets()
    if not (dump.unavailable or (dump.partial and not dump.sockets)):
        return dump.sockets, None
    # Without sock_diag /proc/net/unix gives paths and states, not peers.
    table = {ino: UnixSocketDiag(ino, e.path, None, TCP_LISTEN if e.listening else 1)
             for ino, e in unix_table().items()}
    return table, "sock_diag unavailable: socket peers not resolved (listeners from /proc/net/unix)"


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

    diag, note = _unix_sockets()
    if note:
        rt.notes.append(note)
    inode_pids: dict[int, set[int]] = {}
    seg_pids: dict[str, set[int]] = {str(p): set() for p in seg_paths}
    unreadable = 0
    for pid in all_pids():
        links = fd_links(pid)
        if links is None:
            unreadable += 1
        for t in (links or {}).values():
            found = link_inode(t)
            if found is not None and found[0] == "socket":
                inode_pids.setdefault(found[1], set()).add(pid)
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
        for ino, sock in diag.items():
            if sock.path != path:
                continue
            owners = inode_pids.get(ino, set())
            if sock.state == TCP_LISTEN:
                listeners |= owners
            else:
                servers |= owners
                if sock.peer:
                    peers |= inode_pids.get(sock.peer, set())
        entry.listener_pids = sorted(listeners | servers)
        entry.peer_pids = sorted(peers - listeners - servers) or sorted(peers)
        entry.stale = not listeners
        rt.sockets.append(entry)
    return rt
