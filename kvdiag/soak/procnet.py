"""Which local process listens on a TCP port (psutil), and whether a URL's host is this machine.

Used by ``kvdiag soak --url`` to find the API server of an already running engine, so a stall
can be captured. Read-only; sockets of processes we may not inspect come without a pid and are
skipped.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import psutil


def listening_pids(port: int) -> list[int]:
    """Pids with a listening TCP socket on ``port`` (any address, IPv4 and IPv6; a forked server may
    list several)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return sorted({c.pid for c in conns
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid})


def server_pid(pids: list[int]) -> int | None:
    """Of several holders of one listening socket, the topmost (the one whose parent is not a holder)."""
    if not pids:
        return None
    holders = set(pids)
    for pid in pids:
        try:
            if psutil.Process(pid).ppid() not in holders:
                return pid
        except psutil.Error:
            continue
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
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    out.add(a.address.split("%", 1)[0])   # drop an IPv6 zone ("fe80::1%eth0")
    except (psutil.Error, OSError):
        pass
    return out
