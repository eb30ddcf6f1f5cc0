"""The cross-process wait chain of a verdict (Verdict.waits) as rows a renderer draws; nothing is judged here."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiag.model.verdict import Verdict

_KIND_TEXT = {
    "socket_read": "reads a socket from", "pipe_read": "reads a pipe from",
    "socket_write_full": "is blocked writing a full socket to", "pipe_write_full": "is blocked writing a full pipe to",
    "child_wait": "waits (wait4) for its child", "shared_futex": "waits on a shared futex posted by",
    "shm_ring": "spins on a shared-memory ring advanced by", "zmq": "waits on ZMQ for",
    "ray_get": "waits (ray.get) for",
    "mutex_owner": "waits for the mutex held by", "gil_holder": "waits for the GIL held by",
}


@dataclass
class ChainStep:
    src: str
    dst: str
    words: str
    detail: str            # the OS reading that proves the edge
    inferred: bool


@dataclass
class ChainView:
    steps: list[ChainStep] = field(default_factory=list)
    root: str = ""
    root_state: str = ""
    root_role: str = ""
    root_frames: list[tuple[str, bool]] = field(default_factory=list)   # (frame text, key frame)
    cycle: bool = False
    lost_message: bool = False


def chain_view(verdict: Verdict) -> ChainView | None:
    """The stored chain, first waiter to root, in the words a page shows; None when the verdict has none."""
    w = verdict.waits
    if w is None or not w.edges:
        return None
    view = ChainView(cycle=w.cycle, lost_message=w.lost_message, root_state=w.root_state, root_role=w.root_role)
    for e in w.edges:
        ev = e.evidence
        detail = "; ".join(x for x in (ev.text, ev.mapping and f"mapping {ev.mapping}",
                                       ev.address and f"address {ev.address}", ev.syscall and f"syscall {ev.syscall}")
                           if x)
        view.steps.append(ChainStep(src=w.labels.get(e.src.key(), e.src.key()),
                                    dst=w.labels.get(e.dst.key(), e.dst.key()),
                                    words=_KIND_TEXT.get(e.kind.value, "waits for"), detail=detail,
                                    inferred=e.inferred))
    if w.root is not None:
        view.root = w.labels.get(w.root.key(), w.root.key())
    keys = set(w.root_key_frames)
    view.root_frames = [(f, i in keys) for i, f in enumerate(w.root_frames)]
    return view
