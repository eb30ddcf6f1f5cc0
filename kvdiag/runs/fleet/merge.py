"""Merge bundles captured on several hosts into one: processes keyed by (node, pid), a node table.

The same merge serves a Ray cluster (each node's bundle came back through Ray) and folders collected
any other way (``kvdiag merge DIR...``). Each node's bundle folder is kept whole under the merged
bundle's ``nodes/<node>/``, so every raw path stays valid; the merged bundle.json names them.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kvdiag import __version__
from kvdiag.bundle.io import load_bundle
from kvdiag.defaults import STALL_WINDOW_S
from kvdiag.errors import BundleError, UsageError
from kvdiag.model.bundle import Bundle
from kvdiag.model.environment import EnvironmentRecord
from kvdiag.model.fleet import FleetRecord, NodeRecord
from kvdiag.model.run import Finding

NODES_DIR = "nodes"


@dataclass
class NodePart:
    """One node: its row in the node table and, when it was captured, its bundle and where it lies."""

    record: NodeRecord
    bundle: Bundle | None = None
    folder: Path | None = None       # the node's bundle folder (raw paths in ``bundle`` are relative to it)


def node_dir_name(node: str) -> str:
    """A folder name for ``node`` (an IP, a pod name, ``10.0.0.3/1a2b3c``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", node).strip(".") or "node"


def _prefixed(path: str | None, prefix: str) -> str | None:
    if path is None or path.startswith("/"):
        return path
    return f"{prefix}/{path}"


def _engine_name(node: str, name: str) -> str:
    return name if name.startswith(f"{node}/") else f"{node}/{name}"


def _node_bundle(part: NodePart, rel: str) -> Bundle:
    """The node's bundle with every name made fleet-wide: processes and findings carry the node, engine
    names are prefixed with it (``pid-123`` exists on every node), paths point into ``nodes/<node>/``."""
    assert part.bundle is not None
    node = part.record.node
    b = part.bundle.model_copy(deep=True)
    for p in b.processes:
        p.node = node
        if p.engine:
            p.engine = _engine_name(node, p.engine)
        for t in p.tools:
            t.raw_path = _prefixed(t.raw_path, rel)
    for f in b.findings:
        f.node = node
        if f.engine:
            f.engine = _engine_name(node, f.engine)
    for e in b.engines:
        e.name = _engine_name(node, e.name)
        e.log_path = _prefixed(e.log_path, rel)
    return b


def _fill_record(record: NodeRecord, env: EnvironmentRecord | None, b: Bundle) -> None:
    host = b.host
    record.kernel = record.kernel or (env.kernel if env else None) or host.kernel
    record.machine = record.machine or (env.machine if env else None) or host.machine
    record.python = record.python or (env.python if env else None) or host.python
    if record.cpus is None:
        cpus = env.cpus if env else None
        record.cpus = cpus if cpus is not None else host.cpus
    record.boot_id = record.boot_id or host.boot_id
    record.captured_at = record.captured_at or b.created_at or None
    if not record.pids:
        record.pids = [p.pid for p in b.processes]


def merge_parts(parts: list[NodePart], *, command: str, fleet: FleetRecord,
                out_bundle_dir: Path | None = None) -> Bundle:
    """One bundle from the nodes' bundles (``parts``); a node without one is named with why.

    ``out_bundle_dir``: where the merged bundle will be written; each node's folder is copied into its
    ``nodes/<node>/`` unless it is there already (the Ray path unpacks it there). None: nothing is copied.
    """
    names = [p.record.node for p in parts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"two nodes share the name {dup[0]!r}: name them apart")
    merged = Bundle(kvdiag_version=__version__, command=command,
                    created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), fleet=fleet)
    environment: EnvironmentRecord | None = None
    records: list[NodeRecord] = []
    for part in parts:
        record = part.record.model_copy(deep=True)
        records.append(record)
        if part.bundle is None:
            why = record.reason or record.outcome
            if record.outcome != "no_targets":
                merged.findings.append(Finding(kind="node_not_captured", node=record.node,
                                               message=f"node {record.node}: not captured: {why}"))
            continue
        rel = f"{NODES_DIR}/{node_dir_name(record.node)}"
        record.source = rel
        if out_bundle_dir is not None and part.folder is not None:
            dest = out_bundle_dir / rel
            if dest.resolve() != part.folder.resolve():
                shutil.copytree(part.folder, dest, dirs_exist_ok=True)
        nb = _node_bundle(part, rel)
        _fill_record(record, nb.environment, nb)
        merged.processes += nb.processes
        merged.findings += nb.findings
        merged.engines += nb.engines
        merged.timeline += nb.timeline
        if environment is None and nb.environment is not None:
            environment = nb.environment.model_copy(deep=True)
            merged.host = nb.host.model_copy()
    merged.findings += captures_apart(records)
    merged.environment = environment or EnvironmentRecord()
    merged.environment.nodes = records
    return merged


def _when(record: NodeRecord) -> datetime | None:
    try:
        return datetime.fromisoformat(record.captured_at) if record.captured_at else None
    except ValueError:
        return None


def captures_apart(records: list[NodeRecord], window_s: float = STALL_WINDOW_S) -> list[Finding]:
    """One finding naming the nodes whose captures were written more than the stall window after the
    earliest one, by their own clocks: they were not taken together, or the clocks disagree; either way a
    wait across them is judged from moments that may differ."""
    times = [(r.node, t) for r in records if (t := _when(r)) is not None and t.tzinfo is not None]
    if len(times) < 2:
        return []
    first_node, first = min(times, key=lambda nt: nt[1])
    late = [(n, (t - first).total_seconds()) for n, t in times if (t - first).total_seconds() > window_s]
    if not late:
        return []
    names = ", ".join(f"{n} {d:+.0f} s" for n, d in late)
    return [Finding(kind="captures_apart", message=(
        f"captures written apart by their clocks: {names} after {first_node}, more than the {window_s:g} s stall "
        "window: they were not taken together, or the hosts' clocks disagree; a wait across them is judged "
        "from moments that may differ"))]


def host_identity(part: NodePart) -> tuple[str, frozenset[str]] | None:
    """(boot id, network namespaces of its processes) of a node's capture; None when the bundle does not
    record them (written before they were)."""
    if part.bundle is None:
        return None
    boot = part.bundle.host.boot_id
    spaces = frozenset(p.netns for p in part.bundle.processes if p.netns)
    return (boot, spaces) if boot and spaces else None


def same_host_twice(parts: list[NodePart]) -> str | None:
    """Why two of ``parts`` are captures of one host (the same boot and a shared network namespace): a
    merge joins one capture per host, and two of the same host would pair its connections with themselves.
    None: every capture is of a host of its own."""
    seen: list[tuple[NodePart, tuple[str, frozenset[str]]]] = []
    for part in parts:
        ident = host_identity(part)
        if ident is None:
            continue
        for other, (boot, spaces) in seen:
            if boot == ident[0] and spaces & ident[1]:
                return (f"{other.folder} and {part.folder} are captures of the same host (boot id {boot[:8]}, "
                        f"network namespace {sorted(spaces & ident[1])[0]}): merge one capture per host")
        seen.append((part, ident))
    return None


def load_node_folder(path: Path, name: str | None = None) -> NodePart:
    """A captured folder (``kvdiag capture --out DIR`` on some host) as one node of a merge.

    ``name``: the node's name; default the run folder's name (a pod or host name is the usual choice).
    """
    bundle, bundle_dir = load_bundle(path)
    if bundle.runs:
        raise BundleError(f"{path}: an A/B folder, not one host's capture")
    if bundle.fleet is not None or any(p.node for p in bundle.processes):
        raise BundleError(f"{path}: already a merged bundle; merge the node folders it came from")
    if name is None:
        run_dir = bundle_dir.parent if bundle_dir.name == "bundle" else bundle_dir
        name = run_dir.resolve().name
    record = NodeRecord(node=name, outcome="captured", pids=[p.pid for p in bundle.processes])
    return NodePart(record=record, bundle=bundle, folder=bundle_dir)


def missing_node(path: Path, name: str | None, why: str) -> NodePart:
    """A folder that holds no readable bundle: named in the merged report, not fatal."""
    return NodePart(record=NodeRecord(node=name or path.resolve().name, outcome="refused",
                                      reason=f"no readable bundle in {path}: {why}"))


__all__ = ["NODES_DIR", "NodePart", "captures_apart", "host_identity", "load_node_folder", "merge_parts",
           "missing_node", "node_dir_name", "same_host_twice"]
