"""Fleet capture through Ray: discover with Ray's state API, capture on every node with a task pinned
to it, merge what comes back into one bundle.

Ray already runs an agent on every node and knows every actor's node, pid and current task; kvdiag
rides it instead of bringing a transport of its own. This is the only module that imports ``ray``, and
only inside functions: Ray is a heavy optional dependency (``pip install 'kvdiag[ray]'``) that no other
command may need or pay for at import time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdiag.bundle.io import load_bundle
from kvdiag.capture.orchestrate import CAPTURE_SLACK_S
from kvdiag.errors import KvdiagError, ToolMissing, UsageError
from kvdiag.model.bundle import Bundle
from kvdiag.model.fleet import FleetRecord, NodeOutcome, NodeRecord, RayActorRecord, RayTaskRecord
from kvdiag.model.run import Finding
from kvdiag.runs.fleet.merge import NODES_DIR, NodePart, merge_parts, node_dir_name
from kvdiag.runs.fleet.node import capture_on_node
from kvdiag.runs.fleet.pack import unpack_dir
from kvdiag.runs.fleet.refusal import GENERIC_FAILURE, access_refusal, task_failure
from kvdiag.runs.fleet.select import RayNode, RayWorker, Selection, node_names, select_targets

RAY_HINT = "pip install 'kvdiag[ray]'  (Ray with its dashboard: the state API needs it)"
# On top of the capture's own bound: Ray may first have to start a worker process on the node.
NODE_SLACK_S = 20.0
_STATE_LIMIT = 10_000
_DONE_TASK_STATES = ("FINISHED", "FAILED")


def import_ray() -> Any:
    """The ``ray`` module, or ToolMissing (exit 3) saying how to get it."""
    try:
        import ray
    except ImportError:
        raise ToolMissing("--ray needs Ray, which is not installed for this Python", hint=RAY_HINT) from None
    return ray


@dataclass
class ClusterView:
    """What Ray's state API says about the cluster when capture begins."""

    nodes: list[RayNode] = field(default_factory=list)
    actors: list[RayActorRecord] = field(default_factory=list)   # ``node`` is the node id here
    workers: list[RayWorker] = field(default_factory=list)
    tasks: list[RayTaskRecord] = field(default_factory=list)   # not finished; ``node`` is the node id here
    driver: tuple[str, int] = ("", 0)                          # kvdiag's own (node id, pid)


@dataclass
class NodeCapture:
    """One node's answer: the packed bundle, or why there is none."""

    outcome: NodeOutcome = "captured"
    reason: str | None = None
    pack: bytes | None = None
    seconds: float | None = None
    node_died: bool = False         # the node's raylet went away while its capture ran (the node said so)
    vanished: bool = False          # some of its targets were gone by the end of the capture (the node said so)


def connect(address: str) -> Any:
    """Join the cluster at ``address`` (``auto``: the one ``ray`` would connect to) as a driver."""
    ray = import_ray()
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, namespace="kvdiag")
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UsageError(f"--ray {address}: cannot connect to a Ray cluster: {str(exc).splitlines()[0][:300]}",
                         hint="pass the cluster's address (--ray HOST:6379), or run kvdiag on one of its nodes") \
            from None
    return ray


def _str(x: object) -> str:
    return "" if x is None else str(x)


def discover(ray: Any) -> ClusterView:
    """Nodes, live actors and workers (with node id and pid) and the unfinished tasks, from the state API."""
    from ray.util import state  # ray is optional and heavy: imported by --ray only, after import_ray

    try:
        nodes = state.list_nodes(limit=_STATE_LIMIT, raise_on_missing_output=False)
        actors = state.list_actors(filters=[("state", "=", "ALIVE")], limit=_STATE_LIMIT,
                                   raise_on_missing_output=False)
        workers = state.list_workers(filters=[("is_alive", "=", "True")], limit=_STATE_LIMIT, detail=True,
                                     raise_on_missing_output=False)
        tasks = state.list_tasks(limit=_STATE_LIMIT, detail=True, raise_on_missing_output=False)
    except Exception as exc:  # noqa: BLE001 - the state API raises its own family; one line says it
        raise KvdiagError(f"Ray's state API did not answer: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                          hint="the state API needs Ray's dashboard: start the head with the dashboard "
                               f"(`ray start --head --include-dashboard=true`); {RAY_HINT}") from None
    view = ClusterView(driver=(ray.get_runtime_context().get_node_id(), os.getpid()))
    view.nodes = [RayNode(node_id=n.node_id, address=_str(n.node_ip), head=bool(n.is_head_node),
                          alive=n.state == "ALIVE") for n in nodes]
    view.actors = [RayActorRecord(actor_id=a.actor_id, class_name=_str(a.class_name), name=_str(a.name),
                                  node=_str(a.node_id), pid=a.pid or None, state="ALIVE") for a in actors]
    view.workers = [RayWorker(node_id=_str(w.node_id), pid=int(w.pid), worker_type=_str(w.worker_type))
                    for w in workers if w.pid]
    view.tasks = [RayTaskRecord(task_id=t.task_id, name=_str(t.name), state=_str(t.state), node=t.node_id or None,
                                worker_pid=getattr(t, "worker_pid", None) or None, actor_id=t.actor_id or None,
                                parent_task_id=t.parent_task_id or None)
                  for t in tasks if _str(t.state) not in _DONE_TASK_STATES]
    return view


def run_node_captures(ray: Any, by_node: dict[str, list[int]], *, timeout_s: float, backends: Sequence[str],
                      command: str) -> dict[str, NodeCapture]:
    """One capture task per node, pinned to it (hard affinity), all at once; bounded."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # optional, as above

    task = ray.remote(num_cpus=0, max_retries=0)(capture_on_node)
    began = time.monotonic()
    pending: dict[Any, str] = {}
    for node_id, pids in by_node.items():
        ref = task.options(name="kvdiag-capture",
                           scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)).remote(
            list(pids), timeout_s, list(backends), command)
        pending[ref] = node_id
    out: dict[str, NodeCapture] = {}
    bound = timeout_s + CAPTURE_SLACK_S + NODE_SLACK_S
    while pending:
        left = bound - (time.monotonic() - began)
        if left <= 0:
            break
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        for ref in ready:
            node_id = pending.pop(ref)
            spent = round(time.monotonic() - began, 3)
            try:
                answer = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - every failure is a node outcome, never the run's end
                outcome, reason = task_failure(type(exc).__name__, str(exc))
                out[node_id] = NodeCapture(outcome=outcome, reason=reason, seconds=spent)
                continue
            out[node_id] = NodeCapture(pack=answer["pack"], seconds=spent, node_died=bool(answer.get("node_died")),
                                       vanished=bool(answer.get("vanished")))
    for ref, node_id in pending.items():
        # Not force: the task gets KeyboardInterrupt, and the capture kills its tools and resumes any
        # target they left stopped before the worker ends (a killed worker would leave that undone).
        ray.cancel(ref, force=False)
        out[node_id] = NodeCapture(outcome="unreachable", reason=f"no answer within {bound:.0f}s",
                                   seconds=round(time.monotonic() - began, 3))
    return out


# How long a failure nothing else explains waits for Ray to list its node as dead (its health check's period).
_DEATH_SETTLE_S = 6.0


def _alive_now(ray: Any) -> set[str]:
    from ray.util import state  # ray is optional and heavy: imported by --ray only, after import_ray

    try:
        return {n.node_id for n in state.list_nodes(limit=_STATE_LIMIT, raise_on_missing_output=False)
                if n.state == "ALIVE"}
    except Exception:  # noqa: BLE001 - only sharpens a reason already given
        return set()


def _name_engines(bundle: Bundle, labels: dict[int, str]) -> None:
    """Name each process's group after what Ray calls it (``actor PyAbba (b) pid 12``), not ``pid-12``."""
    renamed: dict[str, str] = {}
    for e in bundle.engines:
        pid = int(e.name[4:]) if e.name.startswith("pid-") and e.name[4:].isdigit() else None
        if pid is not None and pid in labels:
            renamed[e.name] = f"{labels[pid]} pid {pid}"
            e.name = renamed[e.name]
    for p in bundle.processes:
        p.engine = renamed.get(p.engine or "", p.engine)
    for f in bundle.findings:
        f.engine = renamed.get(f.engine or "", f.engine)


def capture_cluster(address: str, out_bundle_dir: Path, *, select: str = "vllm", patterns: Sequence[str] = (),
                    timeout_s: float = 10.0, backends: Sequence[str] = (),
                    progress: Callable[[str], None] | None = None) -> Bundle:
    """Capture the selected processes of every node of the Ray cluster at ``address``: one merged bundle
    (processes keyed by node and pid, a node table, Ray's actor and task tables), not yet written."""
    say = progress or (lambda _msg: None)
    # Ray's driver prints cluster events (a raylet that died) to stdout from its own threads: stdout is
    # kvdiag's (--json), so they go to stderr while connected.
    with contextlib.redirect_stdout(sys.stderr):
        return _capture_cluster(address, out_bundle_dir, select=select, patterns=patterns, timeout_s=timeout_s,
                                backends=backends, say=say)


def _capture_cluster(address: str, out_bundle_dir: Path, *, select: str, patterns: Sequence[str], timeout_s: float,
                     backends: Sequence[str], say: Callable[[str], None]) -> Bundle:
    t0 = time.monotonic()
    ray = connect(address)
    timings = {"connect": round(time.monotonic() - t0, 3)}
    try:
        t1 = time.monotonic()
        view = discover(ray)
        timings["discover"] = round(time.monotonic() - t1, 3)
        sel: Selection = select_targets(view.actors, view.workers, select=select, patterns=list(patterns),
                                        exclude={view.driver})
        if not sel.targets:
            raise UsageError(f"--ray: no process to capture ({sel.described}: none alive)",
                             hint="--select actors|workers, or --actor PATTERN (class or name, shell pattern)")
        names = node_names(view.nodes)
        targets = sel.by_node()
        by_node = {nid: [t.pid for t in ts] for nid, ts in targets.items()}
        say(f"capturing {len(sel.targets)} process(es) ({sel.described}) on {len(by_node)} node(s) of the Ray "
            f"cluster at {address}")
        command = f"capture --ray {address}"
        t2 = time.monotonic()
        answers = run_node_captures(ray, by_node, timeout_s=timeout_s, backends=backends, command=command)
        timings["nodes"] = round(time.monotonic() - t2, 3)
        # Asked after every capture: a node can die after its capture task answered (a small result travels
        # to the driver without its raylet), and what such a node sent is the evidence of a dying host.
        alive = _alive_now(ray)
        # A node killed while its capture ran can answer before Ray marks it dead: a failure nothing else
        # explains (the task failed there, or the processes it read vanished under the tools) waits, bounded,
        # for Ray's view of that node to settle.
        suspects = {nid for nid, a in answers.items() if nid in alive and (
            (a.pack is None and (a.reason or "").startswith(GENERIC_FAILURE)) or a.vanished)}
        settle_until = time.monotonic() + _DEATH_SETTLE_S
        while suspects & alive and time.monotonic() < settle_until:
            time.sleep(0.5)
            alive = _alive_now(ray) or alive
    finally:
        ray.shutdown()
    parts: list[NodePart] = []
    for node in view.nodes:
        name = names.get(node.node_id, node.node_id[:8])
        record = NodeRecord(node=name, node_id=node.node_id, address=node.address or None, head=node.head,
                            pids=by_node.get(node.node_id, []))
        if not node.alive:
            if node.node_id not in by_node:
                continue  # a node that died before this capture: Ray's history, not this cluster
            record.outcome, record.reason = "died", "Ray lists the node as dead"
            parts.append(NodePart(record))
            continue
        answer = answers.get(node.node_id)
        if answer is None:
            record.outcome = "no_targets"
            record.reason = f"no selected process there ({sel.described})"
            parts.append(NodePart(record))
            continue
        record.capture_s = answer.seconds
        if answer.pack is None:
            record.outcome, record.reason = answer.outcome, answer.reason
            if alive and node.node_id not in alive:
                record.outcome = "died"
                record.reason = f"the node died during capture ({answer.reason})"
            parts.append(NodePart(record))
            continue
        record.bytes_moved = len(answer.pack)
        folder = out_bundle_dir / NODES_DIR / node_dir_name(name)
        unpack_dir(answer.pack, folder)
        if answer.node_died or (alive and node.node_id not in alive):
            # Kept in the output folder, not judged: its processes were being killed while they were read.
            record.outcome = "died"
            how = "its raylet went away" if answer.node_died else "Ray lists it as dead"
            record.reason = (f"the node died during capture ({how}; what it sent is kept in "
                             f"{NODES_DIR}/{folder.name})")
            parts.append(NodePart(record))
            continue
        bundle, _ = load_bundle(folder)
        _name_engines(bundle, {t.pid: t.label for t in targets.get(node.node_id, [])})
        refusal = access_refusal(bundle)
        if refusal is not None:
            record.outcome, record.reason = "refused", refusal
        parts.append(NodePart(record, bundle, folder))
    fleet = FleetRecord(source="ray", address=address, selector=sel.described, notes=list(sel.notes), timings=timings,
                        actors=[a.model_copy(update={"node": names.get(a.node or "")}) for a in view.actors],
                        tasks=[t.model_copy(update={"node": names.get(t.node or "", t.node)}) for t in view.tasks])
    merged = merge_parts(parts, command=command, fleet=fleet, out_bundle_dir=out_bundle_dir)
    for part in parts:   # a node whose every process refused the stack tools is named, with the fix
        if part.bundle is not None and part.record.outcome == "refused":
            merged.findings.append(Finding(kind="node_not_captured", node=part.record.node,
                                           message=f"node {part.record.node}: {part.record.reason}"))
    return merged
