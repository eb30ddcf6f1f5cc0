"""vLLM's shared-memory rings (``shm_broadcast.ShmRingBuffer``) as read from /dev/shm: their geometry and the
per-slot flags at both ends of a capture window. The flags are what advances when the ring moves: a spinning
reader or writer burns CPU whether or not it does, so its progress is read here, never from CPU time.

Layout (vLLM 0.x ``ShmRingBuffer``): ``max_chunks`` data chunks of ``max_chunk_bytes``, then ``max_chunks``
metadata blocks of ``1 + n_reader`` bytes: a written flag, then one read flag per reader.
"""

from __future__ import annotations

from pydantic import Field

from kvdiag.model.kinds import _Model


class RingGeometry(_Model):
    """The shape of one ring, solved from its segment size."""

    n_reader: int
    max_chunk_bytes: int
    max_chunks: int

    @property
    def metadata_offset(self) -> int:
        return self.max_chunk_bytes * self.max_chunks

    @property
    def metadata_size(self) -> int:
        return (1 + self.n_reader) * self.max_chunks


class RingReading(_Model):
    """One ring mapped by a captured process, read at the start and the end of the capture window."""

    path: str                            # "/dev/shm/psm_1a2b3c4d"
    dev: str = ""
    inode: int = 0
    size: int = 0
    geometry: RingGeometry
    # Per slot [written, read_0, ..., read_{n-1}] (0/1), at the window's start and end; empty: not read.
    before: list[list[int]] = Field(default_factory=list)
    after: list[list[int]] = Field(default_factory=list)

    @property
    def advanced(self) -> bool | None:
        """Whether any flag changed during the window (None: not read twice)."""
        if not self.before or not self.after:
            return None
        return self.before != self.after

    def unread_by(self, reader: int) -> int:
        """Slots written and not yet read by ``reader`` at the window's end (what it could consume now)."""
        return sum(1 for slot in self.after if slot and slot[0] and len(slot) > reader + 1 and not slot[reader + 1])

    def full(self) -> bool:
        """Every slot written and not read by every reader: the writer has to wait for a reader."""
        return bool(self.after) and all(slot[0] and not all(slot[1:]) for slot in self.after)
