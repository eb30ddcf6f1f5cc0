"""Which local process listens on a TCP port: /proc/net/tcp{,6} inode → /proc/<pid>/fd socket links.

Used by ``kvdiag soak --url`` to find the API server of an already running engine, so a stall
can be captured. Read-only; processes we may not inspect are skipped.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

_LISTEN = "0A"


def listening_inodes(port: int, proc_root: str = "/proc") -> set[int]:
    """Socket inodes of TCP sockets in LISTEN state on ``port`` (any address, IPv4 and IPv6)."""
    inodes: set[int] = set()
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
            _, _, port_hex = parts[1].rpartition(":")
            try:
                if int(port_hex, 16) == port:
                    inodes.add(int(parts[9]))
            except ValueError:
                continue
    inodes.discard(0)
    return inodes


def pids_owning_inodes(inodes: set[int], proc_root: str = "/proc") -> list[int]:
    """Pids that hold a descriptor on one of the socket ``inodes`` (sorted)."""
    if not inodes:
        return []
    wanted = {f"socket:[{i}]" for i in inodes}
    found: list[int] = []
    for entry in os.listdir(proc_root):
        if not entry.isdigit():
            continue
        fd_dir = f"{proc_root}/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in wanted:
                    found.append(int(entry))
                    break
            except OSError:
                continue
    return sorted(found)


def listening_pids(port: int, proc_root: str = "/proc") -> list[int]:
    """Pids with a listening socket on ``port`` (a forked server may list several)."""
    return pids_owning_inodes(listening_inodes(port, proc_root), proc_root)


def server_pid(pids: list[int], proc_root: str = "/proc") -> int | None:
    """Of several holders of one listening socket, the topmost (the one whose parent is not a holder)."""
    if not pids:
        return None
    holders = set(pids)
    for pid in pids:
        try:
            with open(f"{proc_root}/{pid}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid not in holders:
            return pid
    return pids[0]


def url_host_port(url: str) -> tuple[str, int]:
    """Host and port of an http(s) URL (default ports 80/443)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname, port


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine (loopback, unspecified, or one of its addresses)."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return any(is_local_host(str(info[4][0])) for info in infos)
    if addr.is_loopback or addr.is_unspecified:
        return True
    return str(addr) in _local_addresses()


def _local_addresses() -> set[str]:
    out: set[str] = set()
    try:
        with open("/proc/net/fib_trie") as fh:
            lines = fh.read().splitlines()
        for i, line in enumerate(lines):
            if "/32 host LOCAL" in line and i > 0:
                out.add(lines[i - 1].split()[-1])
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as fh:
            for line in fh:
                raw = line.split()[0]
                out.add(str(ipaddress.ip_address(int(raw, 16))))
    except (OSError, ValueError, IndexError):
        pass
    return out
