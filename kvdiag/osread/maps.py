"""A process's memory map (/proc/PID/maps): every mapping, the files mapped, the MAP_SHARED file mappings.

No policy: callers pick what they look for (libpython, a /dev/shm segment, an extension module).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.model.waits import SharedMapping
from kvdiag.osread.files import PROC, read_text
from kvdiag.osread.mem import TargetMemory

# Enough for any service's shared segments; a process mapping thousands of shared files is cut here.
MAX_SHARED_MAPPINGS = 256
_DELETED = " (deleted)"


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str            # "r-xp", "rw-s": the 4th letter is s for MAP_SHARED, p for private
    offset: int
    dev: str
    inode: int
    path: str             # "" for anonymous memory; "[heap]", "[stack]", or a file (may end in " (deleted)")

    @property
    def shared(self) -> bool:
        return len(self.perms) >= 4 and self.perms[3] == "s"


def parse_line(line: str) -> Mapping | None:
    """One maps line, or None when malformed."""
    parts = line.split(None, 5)
    if len(parts) < 5 or not parts[4].isdigit():
        return None
    lo, _, hi = parts[0].partition("-")
    try:
        return Mapping(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), parts[3], int(parts[4]),
                       parts[5].strip() if len(parts) > 5 else "")
    except ValueError:
        return None


def read_maps(pid: int) -> list[Mapping] | None:
    """Every mapping of ``pid`` in address order; None when its maps cannot be read."""
    text = read_text(f"{PROC}/{pid}/maps")
    if text is None:
        return None
    return [m for line in text.splitlines() if (m := parse_line(line)) is not None]


def mapped_files(pid: int) -> list[str]:
    """Absolute paths of the files mapped into ``pid``, each once, in map order; [] when unreadable."""
    seen: dict[str, None] = {}
    for m in read_maps(pid) or []:
        if m.path.startswith("/"):
            seen.setdefault(m.path.removesuffix(_DELETED), None)
    return list(seen)


def _shared(m: Mapping) -> SharedMapping:
    return SharedMapping(start=m.start, end=m.end, perms=m.perms, offset=m.offset, dev=m.dev, inode=m.inode,
                         path=m.path)


def parse_maps_line(line: str) -> SharedMapping | None:
    """One maps line as a shared file mapping, or None (private, anonymous or malformed)."""
    m = parse_line(line)
    return _shared(m) if m is not None and m.shared and m.inode else None


def shared_file_mappings(pid: int, limit: int = MAX_SHARED_MAPPINGS) -> list[SharedMapping] | None:
    """The process's MAP_SHARED file mappings in address order; None when its maps cannot be read."""
    maps = read_maps(pid)
    if maps is None:
        return None
    return [_shared(m) for m in maps if m.shared and m.inode][:limit]


def mapping_at(mappings: list[SharedMapping], addr: int) -> SharedMapping | None:
    """The shared mapping that holds ``addr``."""
    return next((m for m in mappings if m.contains(addr)), None)


def read_head(pid: int, mapping: SharedMapping, size: int = 256) -> bytes | None:
    """The first ``size`` bytes of a shared mapping as the process sees them (/proc/PID/mem, read-only);
    None when the memory may not be read."""
    mem = TargetMemory(pid)
    try:
        return mem.read_upto(mapping.start, min(size, mapping.end - mapping.start))
    finally:
        mem.close()
