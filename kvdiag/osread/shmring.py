"""vLLM's shared-memory rings (``/dev/shm/psm_*``, ``ShmRingBuffer``): their geometry from the segment size and
their per-slot flags, read through /proc/PID/mem at the process's own mapping. No policy."""

from __future__ import annotations

import os

from kvdiag.model.rings import RingGeometry
from kvdiag.model.waits import SharedMapping

MIB = 1024 * 1024
# vLLM's MessageQueue sizes: chunks are whole MiB (24 MiB for the EngineCore/worker queues, 16 MiB for the
# broadcast, 4 MiB for a process group's); 10 chunks by default, 6 for group queues. Any count up to 64
# is tried, fewest readers first.
_CHUNK_COUNTS = (10, 6, 8, 4, 16, 2, 1, 12, 20, 32, 64)
_MAX_READERS = 64


def ring_geometry(size: int) -> RingGeometry | None:
    """The ring a segment of ``size`` bytes holds: ``(max_chunk_bytes + 1 + n_reader) * max_chunks == size`` with
    a whole number of MiB per chunk; None when no such shape fits (not a vLLM ring)."""
    for chunks in _CHUNK_COUNTS:
        if size % chunks:
            continue
        per_chunk = size // chunks
        for n_reader in range(1, _MAX_READERS + 1):
            chunk_bytes = per_chunk - 1 - n_reader
            if chunk_bytes <= 0:
                break
            if chunk_bytes % MIB == 0:
                return RingGeometry(n_reader=n_reader, max_chunk_bytes=chunk_bytes, max_chunks=chunks)
    return None


def segment_size(path: str) -> int | None:
    """Size of a /dev/shm file (None: gone or unreadable, e.g. already unlinked)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def read_ring_flags(pid: int, mapping: SharedMapping, geometry: RingGeometry) -> list[list[int]] | None:
    """Per slot ``[written, read_0, ...]`` as process ``pid`` sees the ring mapped at ``mapping``; None when the
    mapping does not cover the metadata or the memory may not be read."""
    start = mapping.start - mapping.offset + geometry.metadata_offset
    if mapping.offset > geometry.metadata_offset or start + geometry.metadata_size > mapping.end:
        return None
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, geometry.metadata_size, start)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) != geometry.metadata_size:
        return None
    width = 1 + geometry.n_reader
    return [[1 if b else 0 for b in raw[i:i + width]] for i in range(0, len(raw), width)]


__all__ = ["read_ring_flags", "ring_geometry", "segment_size"]
