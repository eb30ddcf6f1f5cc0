"""/proc/net: the host's Unix and TCP socket tables, who listens on a TCP port, and this host's addresses."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from kvdiag.osread.fds import fd_links, held_inodes, link_inode
from kvdiag.osread.files import PROC, read_link, read_text
from kvdiag.osread.stat import all_pids

_UNIX_ACCEPTCON = 0x00010000       # __SO_ACCEPTCON in /proc/net/unix "Flags": a listening socket
TCP_LISTEN_HEX = "0A"              # the st column of a listening socket in /proc/net/tcp
TCP_ESTABLISHED_HEX = "01"


@dataclass(frozen=True)
class UnixNetEntry:
    inode: int
    listening: bool
    path: str | None          # the bound path; accepted sockets show their listener's path, clients none


@dataclass(frozen=True)
class TcpEntry:
    proto: str                # "tcp" or "tcp6"
    inode: int
    local: str                # "ip:port"
    remote: str
    state: str                # the st column in hex ("0A": listening, "01": established)
    local_port: int

    @property
    def listening(self) -> bool:
        return self.state == TCP_LISTEN_HEX


def unix_table() -> dict[int, UnixNetEntry]:
    """inode -> entry of every Unix socket in /proc/net/unix ({} when unreadable)."""
    out: dict[int, UnixNetEntry] = {}
    for line in (read_text(f"{PROC}/net/unix") or "").splitlines()[1:]:
        parts = line.split()
        if len(parts) < 7 or not parts[6].isdigit():
            continue
        try:
            flags = int(parts[3], 16)
        except ValueError:
            continue
        out[int(parts[6])] = UnixNetEntry(int(parts[6]), bool(flags & _UNIX_ACCEPTCON),
                                          parts[7] if len(parts) > 7 else None)
    return out


def _hexaddr(text: str) -> tuple[str, int]:
    addr, port = text.split(":")
    if len(addr) == 8:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(addr, 16)))
    else:
        raw = bytes.fromhex(addr)
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return ip, int(port, 16)


def tcp_table(proc_root: str = PROC) -> list[TcpEntry]:
    """Every TCP socket of /proc/net/tcp and tcp6 (IPv4 first)."""
    out: list[TcpEntry] = []
    for proto in ("tcp", "tcp6"):
        for line in (read_text(f"{proc_root}/net/{proto}") or "").splitlines()[1:]:
            parts = line.split()
            if len(parts) < 10 or not parts[9].isdigit():
                continue
            try:
                (lip, lport), (rip, rport) = _hexaddr(parts[1]), _hexaddr(parts[2])
            except (ValueError, OSError):
                continue
            out.append(TcpEntry(proto, int(parts[9]), f"{lip}:{lport}", f"{rip}:{rport}", parts[3], lport))
    return out


def tcp_connections(pid: int, limit: int = 256) -> list[str] | None:
    """``local -> remote`` of each established TCP socket ``pid`` holds, read from the tables of its own
    network namespace (/proc/PID/net); None when its fds cannot be read."""
    links = fd_links(pid)
    if links is None:
        return None
    held = {found[1] for link in links.values() if (found := link_inode(link)) is not None and found[0] == "socket"}
    conns = [f"{e.local} -> {e.remote}" for e in tcp_table(f"{PROC}/{pid}")
             if e.state == TCP_ESTABLISHED_HEX and e.inode in held]
    return conns[:limit]


def tcp_listeners() -> dict[tuple[str, int], int]:
    """(proto, port) -> inode of every listening TCP socket of the host."""
    return {(e.proto, e.local_port): e.inode for e in tcp_table() if e.listening}


def _listen_table() -> dict[int, int]:
    """Socket inode -> port of every listening TCP socket."""
    return {e.inode: e.local_port for e in tcp_table() if e.listening and e.inode}


def listening_ports(pids: Iterable[int]) -> list[int]:
    """Sorted TCP ports some process of ``pids`` holds a listening socket on."""
    table = _listen_table()
    if not table:
        return []
    return sorted({table[ino] for pid in pids for ino in held_inodes(pid, "socket") if ino in table})


def listening_pids(port: int) -> list[int]:
    """Pids holding a listening TCP socket on ``port`` (any address, IPv4 and IPv6; a forked server may list
    several). Processes whose fds may not be read are left out."""
    wanted = {ino for ino, p in _listen_table().items() if p == port}
    if not wanted:
        return []
    return sorted(pid for pid in all_pids() if held_inodes(pid, "socket") & wanted)


def local_addresses() -> set[str]:
    """Every IPv4/IPv6 address of this host's interfaces (zone suffixes dropped)."""
    out: set[str] = set()
    try:
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    out.add(a.address.split("%", 1)[0])   # drop an IPv6 zone ("fe80::1%eth0")
    except (psutil.Error, OSError):
        pass
    return out


# The st column of /proc/net/tcp, as the kernel's enum names it.
TCP_STATES = {"01": "established", "02": "syn_sent", "03": "syn_recv", "04": "fin_wait1", "05": "fin_wait2",
              "06": "time_wait", "07": "close", "08": "close_wait", "09": "last_ack", "0A": "listen",
              "0B": "closing", "0C": "new_syn_recv"}


@dataclass(frozen=True)
class HeldTcpSocket:
    """One TCP socket of a process: its fd (None: a connection queued on one of its listeners, accepted by
    nobody yet, so held by no fd) and its entry in the tables of the process's own network namespace."""

    fd: int | None
    entry: TcpEntry

    @property
    def state(self) -> str:
        return TCP_STATES.get(self.entry.state, self.entry.state)


@dataclass(frozen=True)
class ProcessTcp:
    """What a process holds of TCP, read in its own network namespace, with that namespace's identity and
    addresses (another host's capture is matched against these)."""

    netns: str | None                 # "net:[4026532...]": the namespace the tables were read in
    sockets: list[HeldTcpSocket]
    addresses: list[str]              # every local address of that namespace (IPv4 and IPv6)


def namespace_addresses(proc_root: str = PROC) -> list[str]:
    """Every local address of the network namespace seen at ``proc_root`` (``/proc/PID``: the process's own):
    IPv4 from ``net/fib_trie`` (its ``/32 host LOCAL`` entries), IPv6 from ``net/if_inet6``."""
    out: dict[str, None] = {}
    last = ""
    for line in (read_text(f"{proc_root}/net/fib_trie") or "").splitlines():
        text = line.strip()
        if text.startswith(("|--", "+--")):
            last = text[3:].strip().split()[0]
        elif text.startswith("/32 host LOCAL") and last:
            out.setdefault(last, None)
    for line in (read_text(f"{proc_root}/net/if_inet6") or "").splitlines():
        parts = line.split()
        if parts and len(parts[0]) == 32:
            try:
                out.setdefault(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(parts[0])), None)
            except (ValueError, OSError):
                continue
    return list(out)


def process_tcp(pid: int, limit: int = 512,
                shared: dict[str, tuple[list[TcpEntry], list[str]]] | None = None) -> ProcessTcp | None:
    """Every TCP socket ``pid`` holds (listening, connected, closing), each with its fd, and the connections
    queued unaccepted on its listeners, from the tables of its own network namespace (``/proc/PID/net``);
    None when its fds cannot be read. ``shared``: the tables already read, by namespace (the processes of
    one tree share theirs, and the kernel walks every socket of the namespace to print them)."""
    links = fd_links(pid)
    if links is None:
        return None
    fds = {found[1]: fd for fd, link in links.items() if (found := link_inode(link)) is not None
           and found[0] == "socket"}
    netns = read_link(f"{PROC}/{pid}/ns/net")
    if shared is not None and netns is not None and netns in shared:
        table, addresses = shared[netns]
    else:
        table, addresses = tcp_table(f"{PROC}/{pid}"), namespace_addresses(f"{PROC}/{pid}")
        if shared is not None and netns is not None:
            shared[netns] = (table, addresses)
    held = [HeldTcpSocket(fds[e.inode], e) for e in table if e.inode in fds]
    listening = {(e.proto, e.local_port) for e in table if e.listening and e.inode in fds}
    # A connection the kernel completed but no process accepted has no inode: it waits on the listener.
    queued = [HeldTcpSocket(None, e) for e in table if e.inode == 0 and not e.listening
              and e.state in ("01", "08") and (e.proto, e.local_port) in listening]
    return ProcessTcp(netns=netns, sockets=(held + queued)[:limit], addresses=addresses)


def boot_id() -> str | None:
    """This host's boot id (the kernel's random id of the current boot): with a network namespace, it tells
    one host (or pod) from another even where hostnames and addresses repeat."""
    text = read_text("/proc/sys/kernel/random/boot_id")
    return text.strip() or None if text else None
