"""The established TCP connections of one process, as ``local -> remote`` (the form FdInfo.address uses)."""

from __future__ import annotations

import os
import socket
import struct

_ESTABLISHED = "01"


def _addr(text: str) -> str:
    addr, port = text.split(":")
    if len(addr) == 8:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(addr, 16)))
    else:
        raw = bytes.fromhex(addr)
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


def tcp_connections(pid: int, limit: int = 256) -> list[str] | None:
    """``local -> remote`` of each established TCP socket ``pid`` holds (its network namespace's tables);
    None when its fds or tables cannot be read."""
    base = f"/proc/{pid}/fd/"
    try:
        inodes = set()
        for fd in os.listdir(base):
            try:
                link = os.readlink(base + fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    except OSError:
        return None
    out: list[str] = []
    for proto in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{proto}", encoding="ascii") as fh:
                next(fh, None)
                for line in fh:
                    parts = line.split()
                    if len(parts) < 10 or parts[3] != _ESTABLISHED or not parts[9].isdigit():
                        continue
                    if int(parts[9]) in inodes:
                        out.append(f"{_addr(parts[1])} -> {_addr(parts[2])}")
                        if len(out) >= limit:
                            return out
        except (OSError, ValueError):
            continue
    return out
