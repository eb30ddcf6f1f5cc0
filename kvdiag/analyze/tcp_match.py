"""One matching of TCP endpoints across the hosts of a merged bundle (``kvdiag merge``, ``capture --ray``). Pure.

On one host, capture names the process at the other end of a connection from /proc. Across hosts, each
captured process's TCP sockets (listening, connected, and the connections queued unaccepted on its
listeners), read in its own network namespace, are keyed by their 4-tuple; the other end of a connection
``L -> R`` seen on one host is the socket ``R -> L`` held on another. Only an exact match counts: addresses
repeat across hosts (pods with the same address, NAT, a service's virtual address), so a pair that several
hosts hold is named as ambiguous and not chosen, and a connection that no captured socket matches exactly is
left unresolved (a listener on the remote address and port is named as a hint, never as the peer). A
loopback connection never leaves its host: it matches only a socket of the same host (the same boot and
network namespace), which a merge of separate hosts never has.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence

Addr = tuple[str, int]
PKey = tuple[str | None, int]


def parse_addr(text: str) -> Addr | None:
    """``"10.0.0.1:7000"`` / ``"::ffff:10.0.0.1:7000"`` / ``"::1:7000"`` -> (canonical ip, port); IPv4-mapped
    IPv6 addresses become their IPv4 address (a dual-stack server's accepted socket shows the client so)."""
    ip, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        addr = ipaddress.ip_address(ip.strip("[]"))
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr), int(port)


def split_connection(text: str | None) -> tuple[Addr, Addr] | None:
    """``"L -> R"`` (FdInfo.address, ProcessEvidence.tcp_connections) -> (local, remote)."""
    if not text or " -> " not in text:
        return None
    local, _, remote = text.partition(" -> ")
    lo, re_ = parse_addr(local), parse_addr(remote)
    return (lo, re_) if lo is not None and re_ is not None else None


def is_loopback(addr: Addr) -> bool:
    return ipaddress.ip_address(addr[0]).is_loopback


def _unspecified(addr: Addr) -> bool:
    return ipaddress.ip_address(addr[0]).is_unspecified


def fmt(addr: Addr) -> str:
    return f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"


@dataclass(frozen=True)
class Endpoint:
    """One socket of one captured process."""

    node: str | None
    pid: int
    fd: int | None                   # None: not recorded (an older bundle), or queued
    local: Addr
    remote: Addr | None              # None for a listener
    state: str = ""
    queued: bool = False             # a connection queued unaccepted on one of the process's listeners

    @property
    def key(self) -> PKey:
        return self.node, self.pid

    def where(self) -> str:
        held = "queued on its listener, not accepted yet" if self.queued else f"fd {self.fd}" if self.fd is not None \
            else ""
        return f"pid {self.pid}{f' on {self.node}' if self.node else ''}" + (f" ({held})" if held else "")


@dataclass
class TcpMatch:
    """The other end of one connection, as the merge can tell it."""

    local: Addr
    remote: Addr
    # "exact": one process on another host holds the other end; "queued": it waits unaccepted on that
    # process's listener; "ambiguous": several hosts hold the same pair; "loopback": the connection stays on
    # its host; "unmatched": no captured socket is its other end.
    how: str
    peers: list[Endpoint] = field(default_factory=list)     # exact and queued: who holds the other end
    candidates: list[Endpoint] = field(default_factory=list)   # ambiguous; unmatched: listeners on R's port
    note: str = ""                   # one line a human reads

    @property
    def resolved(self) -> bool:
        return self.how in ("exact", "queued") and bool(self.peers)


class TcpIndex:
    """Every TCP socket of every captured process of a merged bundle, keyed by its 4-tuple."""

    def __init__(self, bundle: Bundle) -> None:
        hosts = {r.node: r.boot_id for r in (bundle.environment.nodes if bundle.environment else [])}
        self._host: dict[PKey, str] = {}
        self.by_pair: dict[tuple[Addr, Addr], list[Endpoint]] = {}
        self.listeners: dict[int, list[Endpoint]] = {}
        self.addresses: dict[str | None, set[str]] = {}
        for p in bundle.processes:
            # A process's host: its node's boot and its network namespace; without both, its node alone.
            boot = hosts.get(p.node) if p.node is not None else None
            self._host[(p.node, p.pid)] = f"{boot}/{p.netns}" if boot and p.netns else f"node {p.node}"
            self.addresses.setdefault(p.node, set()).update(
                a for x in p.net_addresses or [] if (a := _canon_ip(x)) is not None)
            for ep in self._endpoints(p):
                if ep.remote is None:
                    self.listeners.setdefault(ep.local[1], []).append(ep)
                else:
                    self.by_pair.setdefault((ep.local, ep.remote), []).append(ep)

    @staticmethod
    def _endpoints(p: ProcessEvidence) -> list[Endpoint]:
        out: list[Endpoint] = []
        if p.tcp_sockets is not None:
            for s in p.tcp_sockets:
                local, remote = parse_addr(s.local), parse_addr(s.remote)
                if local is None:
                    continue
                listening = s.state == "listen"
                out.append(Endpoint(p.node, p.pid, s.fd, local, None if listening or remote is None else remote,
                                    s.state, queued=s.fd is None))
            return out
        # A bundle written before the sockets were recorded: its established connections and blocked fds.
        texts = list(p.tcp_connections) + [f.address or "" for t in p.threads for f in t.blocked_fds + t.write_fds
                                           if (f.proto or "").startswith("tcp") and not f.listening]
        for text in dict.fromkeys(texts):
            ends = split_connection(text)
            if ends is not None:
                out.append(Endpoint(p.node, p.pid, None, ends[0], ends[1], "established"))
        return out

    def same_host(self, a: PKey, b: PKey) -> bool:
        ha, hb = self._host.get(a), self._host.get(b)
        return ha is not None and ha == hb

    def other_end(self, waiter: PKey, local: Addr, remote: Addr) -> TcpMatch:
        """Who holds the other end of ``waiter``'s connection ``local -> remote``, on another host."""
        conn = f"{fmt(local)} -> {fmt(remote)}"
        if _unspecified(remote) or remote[1] == 0:
            return TcpMatch(local, remote, "unmatched", note=f"{conn}: not connected")
        found = [e for e in self.by_pair.get((remote, local), []) if e.key != waiter]
        loop = is_loopback(local) or is_loopback(remote)
        if loop:
            found = [e for e in found if self.same_host(waiter, e.key)]
        else:
            found = [e for e in found if e.node != waiter[0]]
        if not found:
            if loop:
                return TcpMatch(local, remote, "loopback", note=(
                    f"{conn} is a loopback connection: its other end is on the same host, and no other bundle "
                    "was captured there"))
            hint = self._listening(waiter, remote)
            note = f"{conn}: no captured socket of another host is its other end"
            if hint:
                note += "; listening on that port: " + ", ".join(e.where() for e in hint) + (
                    " (not matched: the pair differs, e.g. through NAT, a proxy or a service address)")
            return TcpMatch(local, remote, "unmatched", candidates=hint, note=note)
        nodes = {e.node for e in found}
        if len(nodes) > 1:
            return TcpMatch(local, remote, "ambiguous", candidates=found, note=(
                f"{conn}: the same pair is held on {len(nodes)} hosts ({', '.join(sorted(str(n) for n in nodes))}): "
                "addresses reused across hosts, not resolved"))
        queued = all(e.queued for e in found)
        how = "queued" if queued else "exact"
        who = "; ".join(e.where() for e in found)
        verb = "waits unaccepted in the listen queue of" if queued else "other end held by"
        return TcpMatch(local, remote, how, peers=found,
                        note=f"{conn}: {verb} {who} (the 4-tuple matched exactly)")

    def _listening(self, waiter: PKey, remote: Addr) -> list[Endpoint]:
        """Listeners of other hosts on ``remote``'s port that own its address (or listen on every address of
        a host that has it)."""
        out = []
        for e in self.listeners.get(remote[1], []):
            if e.node == waiter[0]:
                continue
            if e.local[0] == remote[0] or (_unspecified(e.local) and remote[0] in self.addresses.get(e.node, set())):
                out.append(e)
        return out


def _canon_ip(text: str) -> str | None:
    try:
        addr = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr)


__all__ = ["Endpoint", "TcpIndex", "TcpMatch", "fmt", "is_loopback", "parse_addr", "split_connection"]
