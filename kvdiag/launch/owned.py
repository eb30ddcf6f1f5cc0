"""What kvdiag may remove: only what its own processes were seen holding, once nobody holds it.

The rule, for every file kvdiag deletes outside its own folders: (1) a process kvdiag started (an engine,
anything under it) was seen mapping or holding the file during the run, and (2) no live process maps or
holds it now. Both are judged by the file's identity (device, inode), never by its name: a name can be
a stranger's (another program's ``sem.mp-*`` or ``psm_*``), and a mapping's name can be stale (glibc
creates a named semaphore under a temporary name and renames it). A file that only looks like a leftover
of the run (its kind of name, created during the run, unused) but was never seen held by kvdiag's
processes is left alone and named instead.

:class:`OwnedFiles` is the ledger: :meth:`OwnedFiles.observe` records what the run's processes hold (at
samples while the run goes on and once more before they are stopped); :func:`sweep_shm` applies the rule.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvdiag.osread.children import children
from kvdiag.osread.holders import FileId, device_of, held_ids
from kvdiag.osread.process import read_environ
from kvdiag.osread.stat import all_pids, all_stats

RUN_ID_ENV = "KVDIAG_RUN_ID"
SHM_DIR = "/dev/shm"
# multiprocessing.shared_memory segments (vLLM's broadcast queues, psm_<hex>) and multiprocessing's named
# semaphores (sem.mp-<id>), left behind when their owner and its resource tracker are killed together.
# They cannot be redirected to the run's folder, so they are swept instead.
SHM_PREFIXES = ("psm_", "sem.mp-")
# vLLM CPU's tensor-parallel all-reduce segments, ``<ident>-<group>-cpushm_<rank>``, named after the
# rendezvous file ``$TMPDIR/vllm_dist_<hex>`` of the engine (its VLLM_DIST_IDENT). vLLM never unlinks them,
# not even on a clean shutdown.
VLLM_DIST_PREFIX = "vllm_dist_"
# A file's ctime may trail the run's start clock by this much and still count as made during the run.
CTIME_SLACK_S = 1.0


def run_processes(groups: Collection[int], run_id: str | None = None) -> list[int]:
    """The live processes of a run: members of its process groups and everything under them (a child
    that left its group included), plus, when ``run_id`` is given, any process carrying its marker."""
    stats = [st for st in all_stats() if st.state not in ("Z", "X")]
    kids: dict[int, list[int]] = {}
    for st in stats:
        kids.setdefault(st.ppid, []).append(st.pid)
    found: dict[int, None] = {}
    queue = [st.pid for st in stats if st.pgid in groups]
    while queue:
        pid = queue.pop()
        if pid not in found:
            found[pid] = None
            queue.extend(kids.get(pid, []))
    if run_id:
        me = os.getpid()
        for st in stats:
            if st.pid not in found and st.pid != me and (read_environ(st.pid) or {}).get(RUN_ID_ENV) == run_id:
                found[st.pid] = None
    return list(found)


def process_trees(roots: Iterable[int]) -> list[int]:
    """``roots`` and their descendants, read from the roots down (/proc/PID/task/*/children): the cheap
    look for periodic samples, whose cost grows with the run's processes, not with the host's."""
    found: dict[int, None] = {}
    queue = list(roots)
    while queue:
        pid = queue.pop()
        if pid in found:
            continue
        kids = children(pid)
        if kids is None:
            continue   # gone
        found[pid] = None
        queue.extend(kids)
    return list(found)


def held_now(devs: Collection[int], skip: Collection[int] = ()) -> set[FileId]:
    """Every file on ``devs`` that some live process maps or holds open now (processes whose maps and fds
    may not be read, another user's, are not seen: kvdiag's own files are 0600 and out of their reach)."""
    out: set[FileId] = set()
    for pid in all_pids():
        if pid not in skip:
            out |= held_ids(pid, devs) or set()
    return out


class OwnedFiles:
    """The identities of the files under ``shm_dir`` that the run's processes were seen holding."""

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self.shm_dir = shm_dir
        dev = device_of(shm_dir)
        self.devs: frozenset[int] = frozenset() if dev is None else frozenset({dev})
        self._seen: set[FileId] = set()
        self._lock = threading.Lock()

    @property
    def seen(self) -> frozenset[FileId]:
        with self._lock:
            return frozenset(self._seen)

    def add(self, ids: Iterable[FileId]) -> None:
        with self._lock:
            self._seen.update(ids)

    def observe(self, pids: Iterable[int]) -> set[FileId]:
        """Record what ``pids`` (processes kvdiag started) map or hold on the shm filesystem now; returns
        the identities not seen before."""
        if not self.devs:
            return set()
        now: set[FileId] = set()
        for pid in pids:
            now |= held_ids(pid, self.devs) or set()
        with self._lock:
            new = now - self._seen
            self._seen |= new
        return new


def vllm_dist_idents(folders: Iterable[str | os.PathLike[str]]) -> list[str]:
    """The ``vllm_dist_<hex>`` rendezvous names in the given run folders (and their ``tmp`` subfolder):
    the prefixes of the /dev/shm segments those engines created."""
    found: list[str] = []
    for folder in folders:
        for where in (os.fspath(folder), os.path.join(os.fspath(folder), "tmp")):
            try:
                names = os.listdir(where)
            except OSError:
                continue
            found += [n for n in names if n.startswith(VLLM_DIST_PREFIX) and n not in found]
    return found


@dataclass
class ShmSweep:
    """What a sweep removed, and what looked like the run's leftovers but was left alone (never seen held
    by the run's processes: not provably kvdiag's)."""

    removed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def sweep_shm(since: float, seen: Collection[FileId], shm_dir: str = SHM_DIR, idents: Iterable[str] = (),
              skip: Collection[int] = ()) -> ShmSweep:
    """Apply the rule to ``shm_dir``: among our uid's shared-memory files named like engines' leftovers
    (SHM_PREFIXES, created since ``since`` epoch s; or ``<ident>-...`` for one of the run's vLLM
    rendezvous ``idents``), remove those whose identity is in ``seen`` and that no live process (other
    than ``skip``) maps or holds; name the unused rest in :attr:`ShmSweep.left`."""
    out = ShmSweep()
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return out
    prefixes = tuple(f"{ident}-" for ident in idents)
    candidates: dict[FileId, str] = {}
    for name in names:
        by_ident = bool(prefixes) and name.startswith(prefixes)
        if not by_ident and not name.startswith(SHM_PREFIXES):
            continue
        try:
            st = os.lstat(os.path.join(shm_dir, name))
        except OSError:
            continue
        if st.st_uid != os.getuid() or not os.path.isfile(os.path.join(shm_dir, name)):
            continue
        if by_ident or st.st_ctime >= since - CTIME_SLACK_S:
            candidates[(st.st_dev, st.st_ino)] = name
    if not candidates:
        return out
    held = held_now({dev for dev, _ in candidates}, skip)
    for fid, name in candidates.items():
        if fid in held:
            continue   # somebody's live file: not a leftover at all
        if fid not in seen:
            out.left.append(name)
            continue
        path = os.path.join(shm_dir, name)
        if _same_file(path, fid):
            try:
                os.unlink(path)
                out.removed.append(name)
            except OSError:
                pass
    return out


def _same_file(path: str, fid: FileId) -> bool:
    """The name still names the file judged (not a new file put there since)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == fid


def remove_unheld(paths: Iterable[str], skip: Collection[int] = ()) -> tuple[list[str], list[str]]:
    """Remove each of ``paths`` (files the caller knows are the run's own: a name only the run could give)
    that no live process maps or holds; returns (removed, kept because held)."""
    ids: dict[FileId, str] = {}
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        ids[(st.st_dev, st.st_ino)] = path
    if not ids:
        return [], []
    held = held_now({dev for dev, _ in ids}, skip)
    removed, kept = [], []
    for fid, path in ids.items():
        if fid in held or not _same_file(path, fid):
            kept.append(path)
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            kept.append(path)
    return removed, kept
