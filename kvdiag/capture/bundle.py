"""Capture one process tree into a bundle folder: discover roles, capture, save bundle.json."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from kvdiag import __version__
from kvdiag.bundle.io import raw_root, save_bundle
from kvdiag.capture.base import CaptureBackend
from kvdiag.capture.discover import find_engine_processes
from kvdiag.capture.follow import note_followed, peers_outside
from kvdiag.capture.logread import log_record
from kvdiag.capture.orchestrate import capture_processes
from kvdiag.capture.ranks import read_rank
from kvdiag.capture.staged import Decider, capture_staged
from kvdiag.environment import collect_environment
from kvdiag.environment.host import host_record
from kvdiag.model.bundle import Bundle
from kvdiag.model.environment import EnvironmentRecord
from kvdiag.model.evidence import ProcessEvidence, TcpSocket
from kvdiag.model.kinds import ProcessRole
from kvdiag.model.run import Finding
from kvdiag.osread.net import ProcessTcp, TcpEntry, process_tcp
from kvdiag.osread.ptable import process_tree


def capture_tree(root_pid: int, bundle_dir: Path, *, timeout_s: float = 10.0,
                 backends: Sequence[str | CaptureBackend] | None = None,
                 log_pids: dict[str, int] | None = None, command: str = "",
                 pids: Sequence[int] | None = None, save: bool = True, follow: bool = True,
                 on_evidence: Callable[[Bundle], None] | None = None, decides: Decider | None = None,
                 focus: Sequence[int] | None = None, beside: Callable[[], None] | None = None) -> Bundle:
    """Capture ``root_pid`` and its descendants read-only into ``bundle_dir`` (bundle.json + raw/<pid>/).

    ``pids`` (default: the whole tree) narrows the capture to those processes of the tree
    (see :func:`kvdiag.capture.select.capture_scope`); the rest as :func:`capture_pids`.
    """
    pids = list(pids) if pids is not None else (process_tree(root_pid) or [root_pid])
    return capture_pids(pids, bundle_dir, roots=[root_pid], timeout_s=timeout_s, backends=backends,
                        log_pids=log_pids, command=command or f"capture --pid {root_pid}", save=save,
                        on_evidence=on_evidence, decides=decides, follow=follow, focus=focus, beside=beside)


def capture_pids(pids: Sequence[int], bundle_dir: Path, *, roots: Sequence[int] | None = None,
                 timeout_s: float = 10.0, backends: Sequence[str | CaptureBackend] | None = None,
                 log_pids: dict[str, int] | None = None, command: str = "", save: bool = True, follow: bool = True,
                 on_evidence: Callable[[Bundle], None] | None = None, decides: Decider | None = None,
                 focus: Sequence[int] | None = None, beside: Callable[[], None] | None = None) -> Bundle:
    """Capture ``pids`` read-only into ``bundle_dir``: what ``kvdiag capture --pid`` does, for processes that
    need not form one tree (the selected workers of one node of a Ray cluster).

    ``roots`` (default: every pid): the processes whose trees name the engine roles and whose log files
    stand in for a run's log follower. One root: every captured process belongs to its log's record.
    The environment record is collected while the tools run; ``on_evidence`` gets the bundle as soon as
    the evidence is in, before the environment (so a caller can say the verdict at once). ``save=False``:
    the caller writes the bundle. ``decides``: capture the engine cores first and the rest with every
    tool only when that does not decide (:mod:`kvdiag.capture.staged`); None: every process, every tool.
    ``focus``: the processes that stage captures first (default: the engine cores).
    ``follow``: the processes outside ``pids`` that a blocked thread waits on are captured too (bounded).
    ``beside``: run in a thread of its own while the tools run (from when the /proc windows have opened); not
    waited for.
    """
    pids = list(pids)
    roots = list(roots) if roots else pids
    roles: dict[ProcessRole, list[int]] = {}
    for root in roots:
        for role, role_pids in find_engine_processes(root, log_pids).items():
            roles.setdefault(role, []).extend(p for p in role_pids if p not in roles.get(role, []))
    # The environment of the engine core (what runs the engine), else of the first root.
    cores = [p for p in roles.get(ProcessRole.ENGINE_CORE, []) if p in pids]
    env_pid = cores[0] if cores else (pids[0] if pids else roots[0])
    env_box: list[EnvironmentRecord] = []
    followed, named = peers_outside(pids) if follow else ([], [])
    every = pids + [p.pid for p in followed]
    # Each one's TCP sockets (what another host's capture is matched with): /proc only.
    tcp_box: dict[int, ProcessTcp | None] = {}

    def read_tcp() -> None:
        shared: dict[str, tuple[list[TcpEntry], list[str]]] = {}
        for pid in every:
            tcp_box[pid] = process_tcp(pid, shared=shared)

    # Beside the capture tools, not after them, and not before the /proc windows have opened (their first
    # samples are read at once, not shared with these): the environment (files and a few short children: the
    # engine's own interpreter asked for its versions), the TCP tables, and the caller's ``beside``.
    works: list[Callable[[], None]] = [lambda: env_box.append(collect_environment(target_pid=env_pid)), read_tcp]
    threads = [threading.Thread(target=w, name=f"kvdiag-beside-{i}", daemon=True)
               for i, w in enumerate([*works, *([beside] if beside is not None else [])])]

    def start_beside() -> None:
        for t in threads:
            if t.ident is None:
                t.start()

    # Each one's rank in a distributed job groups one job's ranks, here and in a merged bundle.
    ranks = {pid: read_rank(pid) for pid in every}

    def with_roles(evidence: list[ProcessEvidence]) -> list[ProcessEvidence]:
        for ev in evidence:
            ev.rank = ranks.get(ev.pid)
            for role, role_pids in roles.items():
                if ev.pid in role_pids:
                    ev.role = role
        return evidence

    first = [p for p in focus if p in every] if focus is not None else cores
    if decides is not None and first:
        judge = decides
        evidence, findings = capture_staged(every, first, raw_root(bundle_dir), timeout_s=timeout_s,
                                            backends=backends, bundle_dir=bundle_dir,
                                            decides=lambda evs, fs: judge(with_roles(evs), fs), on_open=start_beside)
    else:
        evidence, findings = capture_processes(every, raw_root(bundle_dir), timeout_s=timeout_s, backends=backends,
                                               bundle_dir=bundle_dir, on_open=start_beside)
    start_beside()   # no window opened (every process gone): they run now
    findings += note_followed(evidence, followed, named)
    with_roles(evidence)
    threads[1].join()   # the TCP tables: bounded, a few /proc files per process
    for ev in evidence:
        if ev.alive:   # what another host's capture is matched with (kvdiag merge, capture --ray)
            tcp = tcp_box.get(ev.pid)
            if tcp is not None:
                ev.netns, ev.net_addresses = tcp.netns, tcp.addresses
                ev.tcp_sockets = [TcpSocket(fd=s.fd, inode=s.entry.inode, proto=s.entry.proto, local=s.entry.local,
                                            remote=s.entry.remote, state=s.state) for s in tcp.sockets]
    # The engine core first: it is what a reader (and the analyzer's tie-break) looks at first.
    evidence.sort(key=lambda e: (e.role is not ProcessRole.ENGINE_CORE, pids.index(e.pid) if e.pid in pids
                                 else len(pids)))
    engines = []
    if log_pids is None:
        # A bare process: its log file (found through /proc/PID/fd) stands in for a run's log follower.
        for root in roots:
            record = log_record(root, f"pid-{root}")
            if record is None:
                continue
            engines.append(record)
            for ev in evidence:
                if len(roots) == 1 or ev.pid == root:
                    ev.engine = record.name
    bundle = Bundle(kvdiag_version=__version__, command=command or f"capture --pid {roots[0]}",
                    created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    host=host_record(), processes=evidence, findings=findings, engines=engines)
    if on_evidence is not None:
        on_evidence(bundle)
    threads[0].join()   # the environment: bounded, every child it starts has its own timeout
    bundle.environment = env_box[0] if env_box else None
    if save:
        save_bundle(bundle, bundle_dir)
    return bundle


def engine_pids(root_pid: int, log_pids: dict[str, int] | None = None,
                roles: dict[ProcessRole, list[int]] | None = None) -> list[int]:
    """An engine's known processes, EngineCore first, then its API server and workers; when no EngineCore is
    known (a command engine that is not vLLM-shaped), its whole process tree (``[root_pid]`` at least)."""
    roles = roles if roles is not None else find_engine_processes(root_pid, log_pids)
    order: tuple[ProcessRole, ...] = (ProcessRole.ENGINE_CORE, ProcessRole.API_SERVER, ProcessRole.WORKER)
    if not roles.get(ProcessRole.ENGINE_CORE):
        order += (ProcessRole.OTHER,)
    pids: list[int] = []
    for role in order:
        pids += [pid for pid in roles.get(role, []) if pid not in pids]
    return pids or [root_pid]


def capture_engine(name: str, root_pid: int, bundle_dir: Path, *, timeout_s: float,
                   backends: Sequence[str | CaptureBackend] | None = None,
                   log_pids: dict[str, int] | None = None) -> tuple[list[ProcessEvidence], list[Finding]]:
    """Capture one launched engine read-only into ``bundle_dir/raw/<pid>/`` (repro, ab): the same
    raw layout as ``kvdiag capture`` (:func:`kvdiag.bundle.io.raw_dir`); bundle.json names each process's engine.

    The engine's processes as :func:`engine_pids` names them.
    """
    roles = find_engine_processes(root_pid, log_pids)
    # The EngineCore is where a vLLM engine's hangs live: its verdict-critical evidence comes first.
    evidence, findings = capture_processes(engine_pids(root_pid, log_pids, roles), raw_root(bundle_dir),
                                           timeout_s=timeout_s, backends=backends, bundle_dir=bundle_dir,
                                           focus=roles.get(ProcessRole.ENGINE_CORE))
    for ev in evidence:
        ev.engine = name
        for role, role_pids in roles.items():
            if ev.pid in role_pids:
                ev.role = role
    for f in findings:
        f.engine = f.engine or name
    return evidence, findings


__all__ = ["capture_engine", "capture_pids", "capture_tree", "engine_pids"]
