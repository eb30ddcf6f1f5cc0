"""A wait-for graph over threads and the things they wait on, and its cycles.

Nodes are threads (``T<pid>:<tid>``), the GIL of a process (``GIL<pid>``) and
synchronisation objects (``OBJ<pid>:<addr>``). Edges read "waits for" (thread →
object) and "is held by / can only be released by" (object → thread). Some
object → thread edges are inferences (a condition variable's possible
signallers); they carry ``inferred=True`` so a verdict can say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    label: str
    inferred: bool = False


@dataclass
class WaitGraph:
    labels: dict[str, str] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)

    def node(self, node_id: str, label: str) -> str:
        self.labels.setdefault(node_id, label)
        return node_id

    def edge(self, src: str, dst: str, label: str, inferred: bool = False) -> None:
        if src == dst:
            return
        e = Edge(src, dst, label, inferred)
        if e not in self.edges:
            self.edges.append(e)

    def successors(self, node_id: str) -> list[Edge]:
        return [e for e in self.edges if e.src == node_id]

    def cycles(self, limit: int = 20, max_len: int = 12) -> list[list[str]]:
        """Simple cycles, each listed once, starting at its smallest node id."""
        order = sorted(self.labels)
        rank = {n: i for i, n in enumerate(order)}
        found: list[list[str]] = []
        for start in order:
            stack: list[tuple[str, list[str]]] = [(start, [start])]
            while stack and len(found) < limit:
                node, path = stack.pop()
                for e in self.successors(node):
                    if e.dst == start and len(path) > 1:
                        found.append(list(path))
                    elif e.dst not in path and rank.get(e.dst, -1) > rank[start] and len(path) < max_len:
                        stack.append((e.dst, path + [e.dst]))
        return found

    def edge_between(self, src: str, dst: str) -> Edge | None:
        return next((e for e in self.edges if e.src == src and e.dst == dst), None)

    def describe_cycle(self, cycle: list[str]) -> list[str]:
        """Node labels in order (the report draws the arrows; each label says how it waits)."""
        return [self.labels.get(n, n) for n in cycle]
