"""A bundle merged from several hosts: the node table and, for a Ray cluster, what Ray said about it.

A pid is unique only within its node, so every merged process carries ``ProcessEvidence.node``
(a name from :attr:`NodeRecord.node`) and everything keyed by pid is keyed by (node, pid).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvdiag.model.kinds import _Model

NodeOutcome = Literal["captured", "refused", "died", "unreachable", "no_targets"]


class NodeRecord(_Model):
    """One node of a merged bundle, and how its capture went."""

    node: str                        # the name processes carry in ``ProcessEvidence.node``
    node_id: str | None = None       # Ray's node id (a merge of separate folders has none)
    address: str | None = None       # the node's IP as Ray knows it
    head: bool = False
    outcome: NodeOutcome = "captured"
    reason: str | None = None        # why a node gave no evidence (refused, died, kvdiag missing there)
    pids: list[int] = Field(default_factory=list)       # the processes asked for on this node
    source: str | None = None        # bundle folder of this node, relative to the merged bundle folder
    capture_s: float | None = None   # wall time of the node's capture, as the driver saw it
    bytes_moved: int | None = None   # size of the node's packed bundle sent to the driver
    kernel: str | None = None
    machine: str | None = None
    python: str | None = None
    cpus: int | None = None
    # The capture's host as the kernel names its boot (with each process's network namespace, what tells two
    # hosts or pods apart where names and addresses repeat), and when the capture was written, by its clock.
    boot_id: str | None = None
    captured_at: str | None = None


class RayActorRecord(_Model):
    actor_id: str
    class_name: str = ""
    name: str = ""
    node: str | None = None
    pid: int | None = None
    state: str = ""


class RayTaskRecord(_Model):
    """A task Ray's task table listed as not finished when capture began."""

    task_id: str
    name: str = ""                   # "B.work", "f"
    state: str = ""                  # RUNNING, PENDING_..., SUBMITTED_TO_WORKER
    node: str | None = None
    worker_pid: int | None = None
    actor_id: str | None = None
    parent_task_id: str | None = None


class FleetRecord(_Model):
    """Where a merged bundle came from: a Ray cluster (with its tables) or folders merged by hand."""

    source: Literal["ray", "merge"] = "merge"
    address: str | None = None       # the Ray cluster kvdiag connected to
    selector: str = ""               # what was asked for: "vllm", "actors", "workers", "actor name b*"
    actors: list[RayActorRecord] = Field(default_factory=list)
    tasks: list[RayTaskRecord] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    # Where the driver's time went, seconds: "connect", "discover", "nodes" (first task sent → last answer).
    timings: dict[str, float] = Field(default_factory=dict)
