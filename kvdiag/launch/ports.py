"""Which TCP ports a process tree listens on (/proc/net/tcp{,6} + /proc/<pid>/fd), to tell a user whose
engine command ignored the port kvdiag chose where the engine went instead. Read-only."""

from __future__ import annotations

import os
from collections.abc import Iterable

_LISTEN = "0A"


def _listen_table(proc_root: str = "/proc") -> dict[int, int]:
    """Socket inode -> port of every TCP socket in LISTEN state."""
    out: dict[int, int] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc_root}/net/{name}") as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[3] != _LISTEN:
                continue
            try:
                inode = int(parts[9])
                port = int(parts[1].rpartition(":")[2], 16)
            except ValueError:
                continue
            if inode:
                out[inode] = port
    return out


def listening_ports(pids: Iterable[int], proc_root: str = "/proc") -> list[int]:
    """Sorted TCP ports some process of ``pids`` holds a listening socket on."""
    table = _listen_table(proc_root)
    if not table:
        return []
    ports: set[int] = set()
    for pid in pids:
        fd_dir = f"{proc_root}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                port = table.get(int(link[8:-1]))
                if port is not None:
                    ports.add(port)
    return sorted(ports)
