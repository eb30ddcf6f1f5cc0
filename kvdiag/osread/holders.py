"""Who holds a pipe or socket inode, and by which end (/proc/*/fd links, /proc/PID/fdinfo flags). No policy."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

_O_ACCMODE = 0o3
_O_WRONLY = 0o1
_O_RDWR = 0o2


@dataclass
class Holder:
    pid: int
    fd: int
    mode: str = ""        # "r", "w", "rw" ("" when fdinfo could not be read)


@dataclass
class HolderScan:
    by_link: dict[str, list[Holder]] = field(default_factory=dict)
    partial: str | None = None         # why some processes were not scanned (deadline)


def fd_mode(pid: int, fd: int) -> str:
    """"r", "w" or "rw" from the fd's open flags; "" when they cannot be read."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("flags:"):
                    acc = int(line.split()[1], 8) & _O_ACCMODE
                    return "w" if acc == _O_WRONLY else "rw" if acc == _O_RDWR else "r"
    except (OSError, ValueError, IndexError):
        pass
    return ""


def scan_holders(links: set[str], deadline: float | None = None, modes: bool = True) -> HolderScan:
    """Every process holding one of ``links`` ("pipe:[12]", "socket:[34]"), with the fd and (``modes``)
    the end it holds. One pass over /proc/*/fd; cut at ``deadline`` (monotonic), which it says."""
    out = HolderScan()
    if not links:
        return out
    try:
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    except OSError as exc:
        out.partial = f"/proc unreadable ({exc})"
        return out
    for n, pid in enumerate(pids):
        if deadline is not None and n % 64 == 0 and time.monotonic() > deadline:
            out.partial = f"fd scan cut by the deadline after {n} of {len(pids)} processes"
            return out
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
            if link in links:
                out.by_link.setdefault(link, []).append(
                    Holder(pid=pid, fd=int(fd), mode=fd_mode(pid, int(fd)) if modes else ""))
    return out


def tcp_listeners() -> dict[tuple[str, int], int]:
    """(proto, port) -> inode of every listening TCP socket of the host (/proc/net/tcp, tcp6)."""
    out: dict[tuple[str, int], int] = {}
    for proto in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{proto}", encoding="ascii") as fh:
                next(fh, None)
                for line in fh:
                    parts = line.split()
                    if len(parts) >= 10 and parts[3] == "0A" and parts[9].isdigit():
                        out[(proto, int(parts[1].rsplit(":", 1)[1], 16))] = int(parts[9])
        except (OSError, ValueError):
            continue
    return out
