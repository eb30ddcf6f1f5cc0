"""Which local process serves a URL and its one EngineCore: whether the URL's host is this machine, which
holder of the listening socket is the server, the EngineCore under it. ``kvdiag watch`` and ``kvdiag soak
--url`` find a running engine this way, so a stall can be captured. The readings (listeners, addresses)
are kvdiag.osread.net's.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvdiag.capture.select import engine_cores_of
from kvdiag.osread.net import listening_pids, local_addresses
from kvdiag.osread.ptable import alive
from kvdiag.osread.stat import read_stat


@dataclass(frozen=True)
class Located:
    """What discovery found: the API server (the port's listener) and its one EngineCore."""

    server_pid: int | None
    core_pid: int | None
    note: str | None = None     # why no EngineCore was picked (several, none, not local)


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


def local_server(url: str) -> int | None:
    """The process on this machine that listens on ``url``'s port (None: another host, or none visible)."""
    host, port = url_host_port(url)
    return server_pid(listening_pids(port)) if is_local_host(host) else None


def locate(url: str, pid_hint: int | None = None) -> Located:
    """The API server listening on ``url``'s port and its one EngineCore (``pid_hint``: either, given)."""
    host, port = url_host_port(url)
    root: int | None = None
    if pid_hint is not None and alive(pid_hint):
        root = pid_hint
    elif not is_local_host(host):
        return Located(None, None, f"{host} is not this machine: stalls are reported, not captured")
    else:
        root = server_pid(listening_pids(port))
        if root is None:
            return Located(None, None, f"no local process listens on port {port} (or it is another user's)")
    cores = engine_cores_of(root)
    server = None if root in cores else root
    if not cores:
        return Located(server, None, f"no VLLM::EngineCore process under pid {root}")
    if len(cores) > 1:
        return Located(server, None, f"{len(cores)} EngineCore processes under pid {root} "
                       f"({', '.join(map(str, cores))}): name one with --pid")
    return Located(server, cores[0])
