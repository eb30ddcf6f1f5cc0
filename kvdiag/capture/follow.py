"""Follow wait edges out of the captured tree before capturing: the processes a blocked thread waits on.

A thread of the tree blocked reading or writing a socket or pipe (or a ZMQ I/O thread waiting on its
connections) depends on whoever holds the other end. When that process is outside the tree (a service
started elsewhere, a daemonized peer), it is captured too, up to a bound; one kvdiag may not read is
named with why. Read-only and stop-free: /proc only, one host-wide fd scan.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from kvdiag.capture.access import check_target, is_kernel_thread
from kvdiag.capture.fds import FdResolver
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.run import Finding
from kvdiag.model.waits import PeerProcess
from kvdiag.osread.fds import epoll_targets
from kvdiag.osread.syscall import HOST_SYSCALLS, parse_syscall
from kvdiag.osread.tasks import list_tids, read_syscall
from kvdiag.osread.waitargs import blocked_call

# Peers captured beyond the tree, at most: each costs a capture of its own.
MAX_FOLLOWED = 4
_FOLLOW_S = 1.0


def _waited_fds(pid: int) -> list[int]:
    """The fds the process's blocked threads read, write or wait on through epoll."""
    fds: list[int] = []
    for tid in list_tids(pid):
        raw = (read_syscall(pid, tid) or "").strip()
        nr, args = parse_syscall(raw)
        if nr is None or nr < 0 or not args:
            continue
        if nr in HOST_SYSCALLS.get("read", ()):
            fds.append(args[0])
        elif nr in HOST_SYSCALLS.get("epoll", ()):
            fds += epoll_targets(pid, args[0])
        else:
            call = blocked_call(raw)
            if call is not None and call.op == "write" and call.fd is not None:
                fds.append(call.fd)
    return sorted({fd for fd in fds if fd >= 0})


def peers_outside(tree: Sequence[int], bound: int = MAX_FOLLOWED,
                  budget_s: float = _FOLLOW_S) -> tuple[list[PeerProcess], list[PeerProcess]]:
    """(captured, named): the processes outside ``tree`` that its blocked threads wait on; the first
    ``bound`` that kvdiag may read are to be captured, every other one is named with why not."""
    inside = set(tree)
    me = os.getpid()
    deadline = time.monotonic() + budget_s
    found: dict[int, str] = {}
    for pid in tree:
        fds = _waited_fds(pid)
        if not fds or time.monotonic() > deadline:
            continue
        for info in FdResolver(pid, deadline).describe(fds):
            # What the tree depends on: servers it connected to and pipe ends, not its own clients (the
            # peers of connections it accepted wait on it, not the other way round).
            if info.kind not in ("socket", "pipe") or info.listening or info.accepted:
                continue
            for q in info.peer_pids:
                if q not in inside and q != me and q not in found:
                    found[q] = f"pid {pid} waits on its {info.proto or info.kind} {info.kind} (fd {info.fd})"
    captured: list[PeerProcess] = []
    named: list[PeerProcess] = []
    for q, via in found.items():
        if is_kernel_thread(q):
            continue
        access = check_target(q)
        if access.zombie:
            named.append(PeerProcess(pid=q, via=via, why_not="a zombie (exited, not reaped)"))
        elif not access.ptrace_ok:
            named.append(PeerProcess(pid=q, via=via, why_not="; ".join(access.refused) or "may not be read"))
        elif len(captured) >= bound:
            named.append(PeerProcess(pid=q, via=via, why_not=f"over the bound of {bound} followed processes"))
        else:
            captured.append(PeerProcess(pid=q, via=via, captured=True))
    return captured, named


def note_followed(evidence: list[ProcessEvidence], followed: list[PeerProcess],
                  named: list[PeerProcess]) -> list[Finding]:
    """Mark the followed processes' evidence and say, in findings, what was followed and what was not."""
    via = {p.pid: p.via for p in followed}
    for ev in evidence:
        if ev.pid in via:
            ev.followed_from = via[ev.pid]
    if evidence and (followed or named):
        evidence[0].peers_outside = [*followed, *named]
    out = [Finding(kind="followed_peer", pid=p.pid, message=f"captured pid {p.pid} outside the tree: {p.via}")
           for p in followed]
    out += [Finding(kind="peer_not_captured", pid=p.pid, message=(
        f"pid {p.pid} outside the tree was not captured ({p.why_not}): {p.via}")) for p in named]
    return out
