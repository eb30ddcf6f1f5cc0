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
from kvdiag.capture.fds import FdResolver, epoll_targets
from kvdiag.model import Finding, PeerProcess, ProcessEvidence
from kvdiag.osread.waitargs import blocked_call

# Peers captured beyond the tree, at most: each costs a capture of its own.
MAX_FOLLOWED = 4
_READ_FD_NRS = {0, 17, 19, 45, 47, 295}          # read family (x86_64): the fd is the first argument
_EPOLL_NRS = {232, 281}
_FOLLOW_S = 1.0


def _syscalls(pid: int) -> list[str]:
    out: list[str] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall", encoding="ascii") as fh:
                out.append(fh.read().strip())
        except OSError:
            continue
    return out


def _waited_fds(pid: int) -> list[int]:
    """The fds the process's blocked threads read, write or wait on through epoll."""
    fds: list[int] = []
    for raw in _syscalls(pid):
        parts = raw.split()
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        nr = int(parts[0])
        try:
            arg0 = int(parts[1], 16)
        except ValueError:
            continue
        if nr in _READ_FD_NRS:
            fds.append(arg0)
        elif nr in _EPOLL_NRS:
            fds += epoll_targets(pid, arg0)
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
