"""A process's file descriptors: /proc/PID/fd links, /proc/PID/fdinfo, and who holds a socket or pipe."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from kvdiag.osread.files import PROC, list_numeric, read_link, read_text

_LINK = re.compile(r"^(socket|pipe):\[(\d+)\]$")
_TFD = re.compile(r"^tfd:\s*(\d+)\s+events:\s*([0-9a-fA-F]+)", re.MULTILINE)
_O_ACCMODE, _O_WRONLY, _O_RDWR = 0o3, 0o1, 0o2


def link_inode(link: str) -> tuple[str, int] | None:
    """("socket" or "pipe", inode) of an fd link such as ``socket:[123]``; None for anything else."""
    m = _LINK.match(link)
    return (m.group(1), int(m.group(2))) if m else None


def readlink(pid: int, fd: int) -> str | None:
    """What fd ``fd`` of ``pid`` is: "socket:[123]", "pipe:[9]", "anon_inode:[eventpoll]", a path; None if gone."""
    return read_link(f"{PROC}/{pid}/fd/{fd}")


def fd_links(pid: int) -> dict[int, str] | None:
    """fd -> link of every open fd of ``pid``; None when its fd folder may not be read."""
    fds = list_numeric(f"{PROC}/{pid}/fd")
    if fds is None:
        return None
    return {fd: link for fd in fds if (link := readlink(pid, fd)) is not None}


def fd_stat(pid: int, fd: int) -> os.stat_result | None:
    """stat(2) of the file behind the fd (follows the link: the file itself, wherever it lives)."""
    try:
        return os.stat(f"{PROC}/{pid}/fd/{fd}")
    except OSError:
        return None


def epoll_targets(pid: int, epfd: int) -> list[int]:
    """The fds registered in epoll instance ``epfd`` of ``pid`` (from fdinfo)."""
    text = read_text(f"{PROC}/{pid}/fdinfo/{epfd}")
    return [int(m.group(1)) for m in _TFD.finditer(text)] if text else []


@dataclass(frozen=True)
class Holder:
    pid: int
    fd: int
    mode: str = ""        # "r", "w", "rw" ("" when fdinfo could not be read)


@dataclass(frozen=True)
class HolderScan:
    by_link: dict[str, list[Holder]] = field(default_factory=dict)
    partial: str | None = None         # why some processes were not scanned (deadline)


def fd_mode(pid: int, fd: int) -> str:
    """"r", "w" or "rw" from the fd's open flags; "" when they cannot be read."""
    for line in (read_text(f"{PROC}/{pid}/fdinfo/{fd}") or "").splitlines():
        if line.startswith("flags:"):
            try:
                acc = int(line.split()[1], 8) & _O_ACCMODE
            except (ValueError, IndexError):
                return ""
            return "w" if acc == _O_WRONLY else "rw" if acc == _O_RDWR else "r"
    return ""


def scan_holders(links: set[str], deadline: float | None = None, modes: bool = True) -> HolderScan:
    """Every process holding one of ``links`` ("pipe:[12]", "socket:[34]"), with the fd and (``modes``)
    the end it holds, and why the scan is partial (None: every readable process was scanned).

    Every pid of the host, each fd read once (a readlink per fd; a process whose fd folder may not be read
    costs one failed open). The scan stops early only at ``deadline`` (monotonic), and says so: any process
    may hold any end (fork, SCM_RIGHTS), so no subset of pids can be skipped without losing a holder.
    """
    found: dict[str, list[Holder]] = {}
    if not links:
        return HolderScan(found)
    pids = list_numeric(PROC)
    if pids is None:
        return HolderScan(found, "/proc unreadable")
    for n, pid in enumerate(pids):
        if deadline is not None and n % 64 == 0 and time.monotonic() > deadline:
            return HolderScan(found, f"fd scan cut by the deadline after {n} of {len(pids)} processes")
        base = f"{PROC}/{pid}/fd/"
        try:
            fds = os.listdir(base)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(base + fd)
            except OSError:
                continue
            if link in links:
                found.setdefault(link, []).append(
                    Holder(pid=pid, fd=int(fd), mode=fd_mode(pid, int(fd)) if modes else ""))
    return HolderScan(found)


def inode_holders(inodes: set[int], skip_pid: int, deadline: float | None = None
                  ) -> tuple[dict[int, list[int]], str | None]:
    """inode -> pids (other than ``skip_pid``) holding a socket or pipe with that inode, and why the scan is
    partial (see :func:`scan_holders`)."""
    scan = scan_holders({f"{kind}:[{i}]" for i in inodes for kind in ("socket", "pipe")}, deadline, modes=False)
    out: dict[int, list[int]] = {}
    for link, holders in scan.by_link.items():
        lst = out.setdefault(int(link[link.index("[") + 1:-1]), [])
        lst.extend(h.pid for h in holders if h.pid != skip_pid and h.pid not in lst)
    return {ino: pids for ino, pids in out.items() if pids}, scan.partial


def held_inodes(pid: int, kind: str | None = None) -> set[int]:
    """Inodes of the sockets and pipes ``pid`` holds (only ``kind``'s, "socket" or "pipe", when given)."""
    out: set[int] = set()
    for link in (fd_links(pid) or {}).values():
        found = link_inode(link)
        if found is not None and (kind is None or found[0] == kind):
            out.add(found[1])
    return out
