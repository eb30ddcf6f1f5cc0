"""Known upstream defects, recognised from a verdict's kind and its project frames.

A match is by exact signature (a capture of the very stacks the table was
made from) or by pattern: the verdict kind plus frames that must appear on
the cited threads. Names are compared on their last scope, so the real
kvcached (``kvcached::PageAllocator::alloc_page``) and kvdiag's model of it
(``kvdiag::stock::PageAllocator::alloc_page``) match the same entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdiag.kvcached.defects import GIL_HOLDING_ALLOC_PAGE, UNBOUNDED_IPC_READ, KvcachedDefect
from kvdiag.model.kinds import VerdictKind
from kvdiag.model.verdict import KnownDefect, Verdict


@dataclass(frozen=True)
class KnownHang:
    defect: KnownDefect
    kinds: frozenset[VerdictKind]
    # Each entry: a thread must cite one of these frames; different entries may be different threads.
    needs: tuple[frozenset[str], ...]
    signatures: frozenset[str] = field(default_factory=frozenset)


def _known(defect: KvcachedDefect, title: str) -> KnownDefect:
    """How a verdict names a catalogued defect; ``title`` says what this verdict saw of it."""
    return KnownDefect(id=defect.id, title=title, fixed_by=defect.fixed_by, fixed_in=defect.fixed_in,
                       workaround=defect.workaround, url=defect.url)


_PREALLOC_GIL = _known(GIL_HOLDING_ALLOC_PAGE, "prealloc GIL cycle: alloc_page waits with the GIL held while the "
                       "prealloc worker needs the GIL in map_pages (also #334)")
_GIL_HELD_WAIT = _known(GIL_HOLDING_ALLOC_PAGE, "alloc_page waits for the prealloc worker with the GIL held: every "
                        "Python thread stalls behind it (GIL half of #371)")
_RUNTIME_STALL = _known(GIL_HOLDING_ALLOC_PAGE, "runtime stall under load: decode stops while alloc_page waits "
                        "with the GIL held and the prealloc worker needs the GIL in map_pages")
_IPC_READ = _known(UNBOUNDED_IPC_READ, "worker IPC reply awaited with no timeout: a live but stuck worker hangs the "
                   "engine (IPC half of #371)")

KNOWN: tuple[KnownHang, ...] = (
    KnownHang(_PREALLOC_GIL, frozenset({VerdictKind.GIL_CYCLE}),
              (frozenset({"alloc_page"}),
               frozenset({"map_pages", "prealloc_worker", "should_use_worker_ipc", "trigger_preallocation"})),
              # the seed's stacks (tests/fixtures/seed/, kvcached built from fea40de); kvdiag's
              # simulated engines with the stock allocator give the same one
              frozenset({"gil_cycle-3716a34488aa"})),
    KnownHang(_RUNTIME_STALL, frozenset({VerdictKind.DECODE_STALL, VerdictKind.UNKNOWN}),
              (frozenset({"alloc_page"}), frozenset({"map_pages", "prealloc_worker", "should_use_worker_ipc"}))),
    KnownHang(_GIL_HELD_WAIT, frozenset({VerdictKind.GIL_HELD_BLOCKED}), (frozenset({"alloc_page"}),)),
    KnownHang(_IPC_READ, frozenset({VerdictKind.BLOCKED_IPC_READ, VerdictKind.UNKNOWN}),
              (frozenset({"_send_and_receive_message", "broadcast_map_to_kv_tensors",
                          "broadcast_unmap_from_kv_tensors", "broadcast_kv_tensors_created"}),)),
)


def _last(name: str) -> str:
    return name.rsplit("::", 1)[-1]


def match_known(verdict: Verdict, groups: Sequence[Sequence[str]]) -> KnownDefect | None:
    """The known defect this verdict is, or None."""
    for entry in KNOWN:
        if verdict.signature and verdict.signature in entry.signatures:
            return entry.defect.model_copy(update={"match": "signature"})
    names = [{_last(n) for n in g} for g in groups]
    for entry in KNOWN:
        if verdict.kind not in entry.kinds:
            continue
        if all(any(need & g for g in names) for need in entry.needs):
            return entry.defect.model_copy(update={"match": "pattern"})
    return None
