"""Typed wait-for edges across threads and processes, each with the evidence that proves it.

One graph over every captured thread of every captured process (and of every host, for bundles
merged from several nodes): a node is a thread (``tid`` set) or a whole process (``tid`` None, when
the thing waited on is "whoever in that process writes/signals/exits"). An edge reads "``src``
waits for ``dst``". The analyzer (kvdiag.analyze.xproc) builds it; a verdict stores the chain it
followed from the first waiter to the root, and the diagnosis may store the whole graph.

Stored in bundle.json and report.json: every field here is optional or defaulted so bundles written
before it load, and it round-trips through JSON (``model_dump(mode="json")`` / ``model_validate``).
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from kvdiag.model.kinds import _Model


class NodeRef(_Model):
    """A thread (``tid`` set) or a whole process (``tid`` None) on one host."""

    pid: int
    tid: int | None = None
    # The host, as ProcessEvidence.node: a pid is unique only within its node. None: a single-host bundle.
    node: str | None = None

    def key(self) -> str:
        """Stable id for graph algorithms and renderers: ``[node/]P<pid>[:T<tid>]``."""
        where = f"{self.node}/" if self.node else ""
        return f"{where}P{self.pid}" + (f":T{self.tid}" if self.tid is not None else "")

    def process(self) -> NodeRef:
        """The process this node belongs to."""
        return NodeRef(pid=self.pid, node=self.node)


class FrameRef(_Model):
    """One captured frame by reference: index into ThreadEvidence.frames of (pid, tid) on ``node``, or into
    ``frames_by_tool[tool]`` when the citing rule read another tool's stack of that thread."""

    pid: int
    tid: int
    index: int
    node: str | None = None
    tool: str | None = None


class EdgeKind(str, Enum):
    """How a waiter depends on what it waits for."""

    # thread -> thread, inside one process
    MUTEX_OWNER = "mutex_owner"          # a mutex wait -> the owner TID read from the mutex
    GIL_HOLDER = "gil_holder"            # a GIL wait -> the thread holding the GIL
    LOCK_HOLDER = "lock_holder"          # a Python lock wait -> the thread whose frame references that lock
    FUTURE = "future"                    # Future.result()/join -> the thread that would complete it
    QUEUE = "queue"                      # Queue.get()/join() -> the thread(s) that put/task_done
    CONDITION = "condition"              # Condition/Event wait -> the thread(s) that may notify
    # thread -> process (or a thread of it, when known)
    SOCKET_READ = "socket_read"          # read/recv on a connected socket -> the peer (TCP: may be another node)
    PIPE_READ = "pipe_read"              # read on a pipe -> every process holding its write end
    MQUEUE_READ = "mqueue_read"          # mq_receive on a POSIX message queue -> every other process that may send
    SOCKET_WRITE_FULL = "socket_write_full"   # send blocked on a full socket buffer -> the peer (its reader)
    PIPE_WRITE_FULL = "pipe_write_full"  # write blocked on a full pipe -> every process holding its read end
    CHILD_WAIT = "child_wait"            # wait4/waitpid/waitid -> the child (any child for pid -1)
    SHARED_FUTEX = "shared_futex"        # futex in a MAP_SHARED file mapping -> every other process mapping it
    SHM_RING = "shm_ring"                # a spinning reader/writer of a shared-memory ring -> the other side
    ZMQ = "zmq"                          # ZMQ recv (signaler fd) -> the peer of the I/O thread's connections
    RAY_GET = "ray_get"                  # ray.get -> the worker running the producing task
    COLLECTIVE = "collective"            # a rank waiting in a collective -> a rank of its group that is elsewhere
    OTHER = "other"


class EdgeEvidence(_Model):
    """What proves one edge: the cited frames and the OS readings it rests on."""

    frames: list[FrameRef] = Field(default_factory=list)   # the waiter's frames that show the wait
    fd: int | None = None                # the waiter's fd (read/write/poll/ZMQ signaler)
    inode: int | None = None             # socket/pipe inode, or the shared file's inode
    address: str | None = None           # socket address, futex address (hex), ZMQ endpoint
    mapping: str | None = None           # the /proc/PID/maps line of the shared mapping
    syscall: str | None = None           # the raw /proc/PID/task/TID/syscall line
    text: str = ""                       # one line a human reads: "recv on unix socket ... (peer: pid 12)"


class WaitEdge(_Model):
    """``src`` waits for ``dst``; ``inferred``: the edge rests on a possibility (any mapper of a shared
    file may post the futex, any holder of a pipe's write end may write), not on a read owner."""

    src: NodeRef
    dst: NodeRef
    kind: EdgeKind
    evidence: EdgeEvidence = Field(default_factory=EdgeEvidence)
    inferred: bool = False
    # What the waiter waits for: "work" (a server or worker waiting for its next request: idle), "reply"
    # (a call waiting for its answer), "blocked" (data it cannot deliver), "depends" (as stuck as the
    # other end: a parent on its child, a rank at a barrier, a ring reader, a lock owner). "": not said.
    purpose: str = ""


class WaitNode(_Model):
    """A node as the graph describes it: who it is and what it does."""

    ref: NodeRef
    label: str = ""                      # "pid 12 (python3 rep.py) thread 12 (MainThread)"
    role: str | None = None              # "api_server", "engine_core", "worker", ... (ProcessRole value)
    # What the node does, when it is where a chain ends: "blocked", "parked" (waits for work), "running",
    # "progressing" (a known wait loop whose counters advanced), "stopped", "exited", "not_captured".
    state: str = ""
    why: str | None = None               # not captured: why kvdiag could not read it


class WaitChain(_Model):
    """A path of the graph from a first waiter to its root: the thread really stuck, or a cycle."""

    edges: list[WaitEdge] = Field(default_factory=list)    # in order: edges[0].src is the first waiter
    root: NodeRef | None = None          # where the chain ends (the cause), None for a pure cycle
    root_state: str = ""                 # WaitNode.state of the root
    cycle: bool = False                  # the last edge leads back into the chain
    # Every process parked waiting for work while one waits for a reply nobody produces.
    lost_message: bool = False
    labels: dict[str, str] = Field(default_factory=dict)   # NodeRef.key() -> label, for renderers
    # The root thread's cited frames (innermost first, as EvidenceItem.frames) and the indices among them
    # the conclusion rests on: the chain carries them whether or not the verdict's evidence lists the root.
    root_role: str = ""
    root_frames: list[str] = Field(default_factory=list)
    root_key_frames: list[int] = Field(default_factory=list)
    root_refs: list[FrameRef] = Field(default_factory=list)   # the captured frame behind each root_frames line

    def nodes(self) -> list[NodeRef]:
        """The chain's nodes in order (the root last unless it is a cycle)."""
        out = [e.src for e in self.edges]
        if self.edges and not self.cycle:
            out.append(self.edges[-1].dst)
        return out


class WaitGraphRecord(_Model):
    """The whole cross-process wait-for graph of a capture, as stored in the diagnosis."""

    nodes: list[WaitNode] = Field(default_factory=list)
    edges: list[WaitEdge] = Field(default_factory=list)


class SharedMapping(_Model):
    """One MAP_SHARED file mapping of a process (/proc/PID/maps, ``s`` in the permissions): a futex in it
    can be posted by any other process mapping the same file (``dev`` and ``inode`` say which file)."""

    start: int
    end: int
    perms: str = ""                      # "rw-s"
    offset: int = 0
    dev: str = ""                        # "00:1a"
    inode: int = 0
    path: str = ""                       # "/dev/shm/sem.mp-x1 (deleted)", "/dev/shm/psm_1a2b"

    def contains(self, addr: int) -> bool:
        return self.start <= addr < self.end

    def line(self) -> str:
        """The maps line it was read from, for citing."""
        return f"{self.start:x}-{self.end:x} {self.perms} {self.offset:08x} {self.dev} {self.inode} {self.path}"


class PeerProcess(_Model):
    """A process outside the captured tree that a captured thread waits on (followed at capture time)."""

    pid: int
    node: str | None = None
    captured: bool = False               # captured too (its ProcessEvidence is in the bundle)
    why_not: str | None = None           # not captured: why ("owned by uid 0", "over the bound of 4 peers")
    via: str = ""                        # the edge that led to it: "pid 12 reads its unix socket"
