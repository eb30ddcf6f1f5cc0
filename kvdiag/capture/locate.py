"""Which local process serves a URL: whether its host is this machine, and which holder of the listening
socket is the server. Used by ``kvdiag soak --url`` to find the API server of an already running engine,
so a stall can be captured. The readings (listeners, addresses) are kvdiag.osread.net's.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from kvdiag.osread.net import local_addresses
from kvdiag.osread.stat import read_stat


def server_pid(pids: list[int]) -> int | None:
    """Of several holders of one listening socket, the topmost (the one whose parent is not a holder)."""
    if not pids:
        return None
    holders = set(pids)
    for pid in pids:
        st = read_stat(pid)
        if st is not None and st.ppid not in holders:
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
    return str(addr) in local_addresses()
