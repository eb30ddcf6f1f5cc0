"""The matching of TCP endpoints across the hosts of a merged bundle (kvdiag.analyze.tcp_match), and the
merge's checks of its inputs (one capture per host, captures taken together).

The sockets below are shaped as `kvdiag capture` records them (tests/integration/test_merge_tcp_hosts.py
reads real ones from two network namespaces); what is checked here is the rule: only an exact 4-tuple
matches, a pair held on several hosts is ambiguous, loopback stays on its host.
"""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from kvdiag.analyze.tcp_match import TcpIndex, parse_addr, split_connection
from kvdiag.cli.main import main
from kvdiag.model.bundle import Bundle
from kvdiag.model.environment import EnvironmentRecord
from kvdiag.model.evidence import ProcessEvidence, TcpSocket
from kvdiag.model.fleet import NodeRecord
from kvdiag.runs.fleet.merge import NodePart, captures_apart, same_host_twice


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _proc(node: str, pid: int, *socks: tuple[int | None, str, str, str], netns: str = "net:[1]",
          addresses: tuple[str, ...] = ()) -> ProcessEvidence:
    return ProcessEvidence(pid=pid, node=node, netns=netns, net_addresses=list(addresses), tcp_sockets=[
        TcpSocket(fd=fd, local=local, remote=remote, state=state) for fd, local, remote, state in socks])


def _bundle(*procs: ProcessEvidence, boots: dict[str, str] | None = None) -> Bundle:
    nodes = [NodeRecord(node=n, boot_id=(boots or {}).get(n, f"boot-{n}")) for n in dict.fromkeys(
        p.node for p in procs if p.node)]
    return Bundle(processes=list(procs), environment=EnvironmentRecord(nodes=nodes))


SERVER = ("host-a", 10)
CLIENT = ("host-b", 20)


def test_addresses_fold_ipv4_mapped_and_split_connections() -> None:
    assert parse_addr("::ffff:10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert parse_addr("::1:7000") == ("::1", 7000)
    assert parse_addr("nonsense") is None
    assert split_connection("10.0.0.2:5000 -> 10.0.0.1:7000") == (("10.0.0.2", 5000), ("10.0.0.1", 7000))


def test_an_exact_pair_on_another_host_is_the_other_end_even_through_a_dual_stack_socket() -> None:
    b = _bundle(_proc("host-a", 10, (3, ":::7000", ":::0", "listen"),
                      (5, "::ffff:10.0.0.1:7000", "::ffff:10.0.0.2:5000", "established")),
                _proc("host-b", 20, (4, "10.0.0.2:5000", "10.0.0.1:7000", "established")))
    m = TcpIndex(b).other_end(CLIENT, ("10.0.0.2", 5000), ("10.0.0.1", 7000))
    assert m.how == "exact" and [e.key for e in m.peers] == [SERVER] and "fd 5" in m.note


def test_a_connection_not_accepted_yet_waits_on_the_listener_that_queued_it() -> None:
    b = _bundle(_proc("host-a", 10, (3, "10.0.0.1:7000", "0.0.0.0:0", "listen"),
                      (None, "10.0.0.1:7000", "10.0.0.2:5000", "established")),
                _proc("host-b", 20, (4, "10.0.0.2:5000", "10.0.0.1:7000", "established")))
    m = TcpIndex(b).other_end(CLIENT, ("10.0.0.2", 5000), ("10.0.0.1", 7000))
    assert m.how == "queued" and m.resolved and "listen queue" in m.note


def test_a_pair_held_on_two_hosts_is_ambiguous_and_not_chosen() -> None:
    # pods of two clusters with the same addresses: both hold 10.0.0.1:7000 <- 10.0.0.2:5000
    b = _bundle(_proc("host-a", 10, (5, "10.0.0.1:7000", "10.0.0.2:5000", "established")),
                _proc("host-c", 10, (5, "10.0.0.1:7000", "10.0.0.2:5000", "established")),
                _proc("host-b", 20, (4, "10.0.0.2:5000", "10.0.0.1:7000", "established")))
    m = TcpIndex(b).other_end(CLIENT, ("10.0.0.2", 5000), ("10.0.0.1", 7000))
    assert m.how == "ambiguous" and not m.resolved and "host-a" in m.note and "host-c" in m.note


def test_no_exact_pair_is_unmatched_and_a_listener_there_only_a_hint() -> None:
    # through NAT: the server sees the connection from another address and port
    b = _bundle(_proc("host-a", 10, (3, "0.0.0.0:7000", "0.0.0.0:0", "listen"),
                      (5, "10.0.0.1:7000", "192.168.0.9:33000", "established"), addresses=("10.0.0.1",)),
                _proc("host-b", 20, (4, "10.0.0.2:5000", "10.0.0.1:7000", "established")))
    m = TcpIndex(b).other_end(CLIENT, ("10.0.0.2", 5000), ("10.0.0.1", 7000))
    assert m.how == "unmatched" and not m.resolved
    assert [e.key for e in m.candidates] == [SERVER] and "NAT" in m.note


def test_loopback_stays_on_its_host() -> None:
    socks = ((5, "127.0.0.1:7000", "127.0.0.1:5000", "established"),)
    client = (4, "127.0.0.1:5000", "127.0.0.1:7000", "established")
    apart = _bundle(_proc("host-a", 10, *socks), _proc("host-b", 20, client))
    m = TcpIndex(apart).other_end(CLIENT, ("127.0.0.1", 5000), ("127.0.0.1", 7000))
    assert m.how == "loopback" and not m.resolved
    # two nodes of one host (Ray raylets sharing a namespace): the same boot and namespace, so it matches
    together = _bundle(_proc("host-a", 10, *socks), _proc("host-b", 20, client), boots={"host-a": "x", "host-b": "x"})
    m = TcpIndex(together).other_end(CLIENT, ("127.0.0.1", 5000), ("127.0.0.1", 7000))
    assert m.how == "exact" and [e.key for e in m.peers] == [SERVER]


def _part(name: str, boot: str, netns: str, at: str) -> NodePart:
    b = Bundle(host={"boot_id": boot}, created_at=at, processes=[ProcessEvidence(pid=1, netns=netns)])
    return NodePart(record=NodeRecord(node=name, captured_at=at), bundle=b, folder=Path(f"/captures/{name}"))


def test_one_capture_per_host_and_captures_taken_together() -> None:
    a = _part("a", "boot1", "net:[1]", "2026-01-01T00:00:00+00:00")
    b = _part("b", "boot1", "net:[2]", "2026-01-01T00:00:03+00:00")     # a pod beside it: its own namespace
    c = _part("c", "boot1", "net:[1]", "2026-01-01T00:00:30+00:00")     # host a again
    assert same_host_twice([a, b]) is None
    why = same_host_twice([a, b, c])
    assert why is not None and "/captures/a" in why and "/captures/c" in why and "same host" in why
    assert captures_apart([a.record, b.record]) == []
    found = captures_apart([a.record, b.record, c.record])
    assert len(found) == 1 and "c +30 s after a" in found[0].message


# Two real captures (tests/integration/test_merge_tcp_hosts.py, native case): host-b's client waits for the
# reply of host-a's server over 10.231.39.2:49500 -> 10.231.39.1:7000; the server's handler is in a native
# lock-order inversion with its "reindexer" thread.
TWO_HOSTS = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "tcp_two_hosts"


def _hosts(tmp_path: Path, **renamed: str) -> Path:
    """The two captures, plus copies of host-a under other names in another network namespace of their own
    (``name=netns``: a pod of another cluster with the same addresses)."""
    for name in ("host-a", "host-b"):
        shutil.copytree(TWO_HOSTS / name, tmp_path / name)
    for name, netns in renamed.items():
        data = json.loads((TWO_HOSTS / "host-a" / "bundle.json").read_text())
        for p in data["processes"]:
            p["netns"] = netns
        (tmp_path / name).mkdir()
        (tmp_path / name / "bundle.json").write_text(json.dumps(data))
    return tmp_path


def test_merged_captures_name_the_servers_hang_at_the_end_of_the_clients_chain(tmp_path: Path) -> None:
    d = _hosts(tmp_path)
    code, out, _ = _run("merge", str(d / "host-b"), str(d / "host-a"), "--out", str(d / "m"), "--json")
    v = json.loads(out)["verdict"]
    assert code == 10 and v["kind"] == "lock_order_inversion", v["summary"]
    edge = v["waits"]["edges"][0]
    assert edge["kind"] == "socket_read" and edge["purpose"] == "reply"
    assert (edge["src"]["node"], edge["dst"]["node"]) == ("host-b", "host-a")
    assert v["waits"]["root"]["node"] == "host-a"
    assert any("pthread_mutex_lock" in f for f in v["waits"]["root_frames"])
    assert v["summary"].startswith("request stuck across processes") and "10.231.39.1:7000" in v["summary"]
    assert {e["node"] for e in v["evidence"]} == {"host-a", "host-b"}
    # captured one after the other: more than the stall window apart, said, and the chain at most medium
    assert any(f["kind"] == "captures_apart" for f in v["findings"]) and v["confidence"] == "medium"


def test_a_pair_held_on_two_hosts_is_said_and_no_chain_is_guessed(tmp_path: Path) -> None:
    d = _hosts(tmp_path, **{"host-c": "net:[1]"})
    code, out, _ = _run("merge", str(d / "host-b"), str(d / "host-a"), str(d / "host-c"), "--out", str(d / "m"),
                        "--json")
    v = json.loads(out)["verdict"]
    assert code == 10
    ambiguous = [f for f in v["findings"] if f["kind"] == "tcp_peer_ambiguous"]
    assert ambiguous and "host-a" in ambiguous[0]["message"] and "host-c" in ambiguous[0]["message"]
    assert not any(e["kind"] == "socket_read" for e in (v["waits"] or {}).get("edges", [])), v["waits"]


def test_merge_refuses_the_same_host_twice(tmp_path: Path) -> None:
    d = _hosts(tmp_path)
    shutil.copytree(d / "host-a", d / "host-a-again")
    code, _, err = _run("merge", str(d / "host-a"), str(d / "host-a-again"), str(d / "host-b"), "--out",
                        str(d / "m"))
    assert code == 2 and "same host" in err and len([ln for ln in err.splitlines() if ln.strip()]) <= 2, err
