"""vLLM's shared-memory rings of one process, read at both ends of the capture's /proc window.

A ring's reader and writer spin or nap whether or not it moves; what moves is its per-slot flags. For every
``/dev/shm/psm_*`` mapping whose size is a ring's (:func:`kvdiag.osread.shmring.ring_geometry`), the flags are
read through the process's own mapping at the window's start and end (read-only, nothing is paused).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiag.model.rings import RingReading
from kvdiag.model.waits import SharedMapping
from kvdiag.osread.shmring import read_ring_flags, ring_geometry, segment_size

_RING_PREFIX = "/dev/shm/psm_"
_MAX_RINGS = 16


@dataclass
class RingWindow:
    pid: int
    readings: list[tuple[SharedMapping, RingReading]] = field(default_factory=list)


def begin(pid: int, maps: list[SharedMapping] | None) -> RingWindow:
    """The rings among ``maps`` and their flags now."""
    w = RingWindow(pid=pid)
    seen: set[tuple[str, int]] = set()
    for m in maps or []:
        if not m.path.startswith(_RING_PREFIX) or (m.dev, m.inode) in seen or len(w.readings) >= _MAX_RINGS:
            continue
        seen.add((m.dev, m.inode))
        path = m.path.removesuffix(" (deleted)")
        size = segment_size(path)
        geometry = ring_geometry(size) if size else None
        if geometry is None or size is None:
            continue
        flags = read_ring_flags(pid, m, geometry)
        if flags is None:
            continue
        w.readings.append((m, RingReading(path=path, dev=m.dev, inode=m.inode, size=size, geometry=geometry,
                                          before=flags)))
    return w


def finish(w: RingWindow) -> list[RingReading] | None:
    """The same rings read again; None when the process maps none."""
    if not w.readings:
        return None
    out = []
    for m, r in w.readings:
        after = read_ring_flags(w.pid, m, r.geometry)
        out.append(r.model_copy(update={"after": after or []}))
    return out


__all__ = ["RingWindow", "begin", "finish"]
