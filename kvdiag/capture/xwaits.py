"""Capture what a thread's wait depends on outside its own process (read-only, stop-free).

Inside the /proc progress window (kvdiag.capture.procfs calls :func:`begin` and :func:`finish`):
the process's MAP_SHARED file mappings and their first bytes at both ends of the window (a ring's
indices advance or not), its children, and per blocked thread the write's fd and its readers, the
pid a wait4/waitid waits for, the shared file a futex lies in, which end of a pipe every other
process holds, and the process that would have to accept a TCP connection nobody holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiag.capture import vllmrings
from kvdiag.capture.fds import FdResolver, pipe_link
from kvdiag.model.evidence import FdInfo, ProcessEvidence, ThreadEvidence
from kvdiag.model.waits import SharedMapping
from kvdiag.osread.children import children
from kvdiag.osread.fds import scan_holders
from kvdiag.osread.maps import mapping_at, read_head, shared_file_mappings
from kvdiag.osread.net import tcp_listeners
from kvdiag.osread.status import read_status
from kvdiag.osread.waitargs import blocked_call

# Only these shared mappings are sampled for progress: /dev/shm segments (rings, queues, semaphores).
_SAMPLED_PREFIXES = ("/dev/shm/",)
_MAX_SAMPLED = 16
_HEAD_BYTES = 256


def mapping_key(m: SharedMapping) -> str:
    return f"{m.dev}:{m.inode}"


@dataclass
class SharedWindow:
    pid: int
    maps: list[SharedMapping] | None = None
    heads: dict[str, bytes] = field(default_factory=dict)
    rings: vllmrings.RingWindow | None = None


def _sampled(maps: list[SharedMapping]) -> list[SharedMapping]:
    seen: set[str] = set()
    out: list[SharedMapping] = []
    for m in maps:
        # Any writable shared file mapping can carry a ring or a counter somebody polls, whatever its layout.
        if (m.path.startswith(_SAMPLED_PREFIXES) or "w" in m.perms) and mapping_key(m) not in seen:
            seen.add(mapping_key(m))
            out.append(m)
    return out[:_MAX_SAMPLED]


def begin(pid: int) -> SharedWindow:
    """First reading: the shared mappings and their heads."""
    w = SharedWindow(pid=pid, maps=shared_file_mappings(pid))
    w.rings = vllmrings.begin(pid, w.maps)
    for m in _sampled(w.maps or []):
        head = read_head(pid, m, _HEAD_BYTES)
        if head is not None:
            w.heads[mapping_key(m)] = head
    return w


def finish(w: SharedWindow, proc: ProcessEvidence, threads: list[ThreadEvidence], resolver: FdResolver,
           deadline: float | None = None) -> None:
    """Second reading and the per-thread dependencies; fills the optional fields of ``proc``/``threads``
    (``resolver``: the process's fd resolver, shared with the reads)."""
    pid = w.pid
    proc.shared_maps = w.maps
    proc.shm_rings = vllmrings.finish(w.rings) if w.rings is not None else None
    proc.children = children(pid)
    if proc.children is not None:
        proc.exited_children = [c for c in proc.children if (st := read_status(c)) is not None and st.state == "Z"]
    if proc.progress is not None:
        for m in _sampled(w.maps or []):
            before = w.heads.get(mapping_key(m))
            after = read_head(pid, m, _HEAD_BYTES) if before is not None else None
            if before is not None and after is not None:
                proc.progress.shared_changed[mapping_key(m)] = before != after
    writes: dict[int, int] = {}
    for th in threads:
        call = blocked_call(th.syscall)
        if call is not None and call.op == "wait":
            th.waited_pid = call.pid
        elif call is not None and call.op == "write" and call.fd is not None and call.fd >= 0:
            writes[th.tid] = call.fd
        if th.futex_addr is not None and w.maps:
            th.futex_mapping = mapping_at(w.maps, th.futex_addr)
    if writes:
        infos = {i.fd: i for i in resolver.describe(sorted(set(writes.values())))}
        for th in threads:
            if th.tid in writes and writes[th.tid] in infos:
                th.write_fds = [infos[writes[th.tid]].model_copy()]
    _pipe_ends(pid, [f for th in threads for f in (*th.blocked_fds, *th.write_fds)], deadline)
    _listeners([f for th in threads for f in (*th.blocked_fds, *th.write_fds)], deadline)


def _pipe_ends(pid: int, infos: list[FdInfo], deadline: float | None) -> None:
    pipes = [f for f in infos if f.kind == "pipe" and f.inode is not None]
    if not pipes:
        return
    scan = scan_holders({pipe_link(f) for f in pipes}, deadline)
    for f in pipes:
        holders = [h for h in scan.by_link.get(pipe_link(f), []) if h.pid != pid]
        f.reader_pids = sorted({h.pid for h in holders if "r" in h.mode or not h.mode})
        f.writer_pids = sorted({h.pid for h in holders if "w" in h.mode or not h.mode})
        f.partial = f.partial or scan.partial


def _listeners(infos: list[FdInfo], deadline: float | None) -> None:
    orphans = [f for f in infos if f.kind == "socket" and f.proto in ("tcp", "tcp6") and not f.listening
               and not f.peer_pids and f.address and " -> " in f.address]
    if not orphans:
        return
    listening = tcp_listeners()
    wanted: dict[int, list[FdInfo]] = {}
    for f in orphans:
        remote = (f.address or "").split(" -> ", 1)[1]
        port = remote.rpartition(":")[2]
        if port.isdigit() and (ino := listening.get((f.proto or "tcp", int(port)))) is not None:
            wanted.setdefault(ino, []).append(f)
    if not wanted:
        return
    scan = scan_holders({f"socket:[{ino}]" for ino in wanted}, deadline, modes=False)
    for ino, fs in wanted.items():
        pids = sorted({h.pid for h in scan.by_link.get(f"socket:[{ino}]", [])})
        for f in fs:
            f.listener_pids = pids
