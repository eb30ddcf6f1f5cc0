"""Which processes of a Ray cluster to capture: a pure choice over Ray's state tables."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from kvdiag.errors import UsageError
from kvdiag.model.fleet import RayActorRecord

SELECTORS = ("vllm", "actors", "workers")
# vLLM's Ray actors: the tensor/pipeline-parallel workers (RayWorkerWrapper) and the data-parallel
# engine cores (EngineCoreActor, DPEngineCoreActor, DPMoEEngineCoreActor).
_VLLM_ACTOR = re.compile(r"RayWorkerWrapper|EngineCoreActor")


@dataclass(frozen=True)
class RayNode:
    """A node of Ray's node table: ``address`` its IP ("" when Ray gave none), ``alive`` whether Ray listed it
    ALIVE when the cluster was read."""

    node_id: str
    address: str = ""
    head: bool = False
    alive: bool = True


@dataclass(frozen=True)
class NodeProcess:
    """A process of the cluster: a pid names a process only together with its node's id."""

    node_id: str
    pid: int


@dataclass(frozen=True)
class RayWorker(NodeProcess):
    worker_type: str                 # WORKER, DRIVER, SPILL_WORKER, RESTORE_WORKER


@dataclass(frozen=True)
class Target(NodeProcess):
    label: str                       # "actor B (b)", "driver", "worker"


@dataclass
class Selection:
    targets: list[Target] = field(default_factory=list)
    described: str = ""
    notes: list[str] = field(default_factory=list)

    def by_node(self) -> dict[str, list[Target]]:
        out: dict[str, list[Target]] = {}
        for t in self.targets:
            out.setdefault(t.node_id, []).append(t)
        return out


def _actor_label(a: RayActorRecord) -> str:
    return f"actor {a.class_name}" + (f" ({a.name})" if a.name else "")


def _actor_targets(actors: list[RayActorRecord]) -> list[Target]:
    return [Target(a.node or "", a.pid or 0, _actor_label(a)) for a in actors]


def select_targets(actors: list[RayActorRecord], workers: list[RayWorker], *, select: str = "vllm",
                   patterns: list[str] | None = None, exclude: set[tuple[str, int]] | None = None) -> Selection:
    """The processes to capture.

    ``select``: ``vllm`` (vLLM's Ray actors, and the drivers: a vLLM EngineCore that runs its workers on
    Ray is a Ray driver; every actor when the cluster has no vLLM actor), ``actors`` (every live actor),
    ``workers`` (every live worker and driver process). ``patterns``: shell patterns on an actor's
    class or name (``--actor``); they narrow any selector to the actors they match. ``exclude``:
    (node id, pid) never captured (kvdiag's own driver). An actor's ``node`` is Ray's node id here.
    """
    if select not in SELECTORS:
        raise UsageError(f"--select {select}: one of {', '.join(SELECTORS)}")
    skip = exclude or set()
    live = [a for a in actors if a.pid]
    sel = Selection()
    pats = [p for p in patterns or [] if p]
    if pats:
        chosen = [a for a in live if any(fnmatch.fnmatchcase(a.class_name, p) or fnmatch.fnmatchcase(a.name, p)
                                         for p in pats)]
        sel.described = f"actors matching {' '.join(pats)}"
        sel.targets = _actor_targets(chosen)
    elif select == "workers":
        sel.described = "every worker"
        labels = {(a.node or "", a.pid): _actor_label(a) for a in live}
        sel.targets = [Target(w.node_id, w.pid, labels.get((w.node_id, w.pid), w.worker_type.lower()))
                       for w in workers if w.worker_type in ("WORKER", "DRIVER")]
    elif select == "actors":
        sel.described = "every actor"
        sel.targets = _actor_targets(live)
    else:
        vllm = [a for a in live if _VLLM_ACTOR.search(a.class_name)]
        if vllm:
            sel.described = "vLLM actors and drivers"
            sel.targets = _actor_targets(vllm)
            sel.targets += [Target(w.node_id, w.pid, "driver") for w in workers if w.worker_type == "DRIVER"]
        else:
            sel.described = "every actor (no vLLM actor in the cluster)"
            sel.notes.append("no vLLM actor (RayWorkerWrapper, EngineCoreActor) in the cluster: every actor "
                             "is captured")
            sel.targets = _actor_targets(live)
    seen: set[tuple[str, int]] = set()
    unique: list[Target] = []
    for t in sel.targets:
        key = (t.node_id, t.pid)
        if key in seen or key in skip or t.pid <= 0:
            continue
        seen.add(key)
        unique.append(t)
    sel.targets = unique
    return sel


def node_names(nodes: list[RayNode]) -> dict[str, str]:
    """A readable, unique name per node id: its address, with the id's head when two share one."""
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n.address] = counts.get(n.address, 0) + 1
    return {n.node_id: (n.address if n.address and counts[n.address] == 1 else f"{n.address or 'node'}/{n.node_id[:6]}")
            for n in nodes}
