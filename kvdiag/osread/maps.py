"""MAP_SHARED file mappings of a process (/proc/PID/maps), with their address ranges. No policy."""

from __future__ import annotations

import os

from kvdiag.model import SharedMapping

# Enough for any service's shared segments; a process mapping thousands of shared files is cut here.
MAX_SHARED_MAPPINGS = 256


def parse_maps_line(line: str) -> SharedMapping | None:
    """One maps line as a shared file mapping, or None (private, anonymous or malformed)."""
    parts = line.split(None, 5)
    if len(parts) < 5:
        return None
    span, perms, offset, dev, inode = parts[:5]
    if len(perms) < 4 or perms[3] != "s" or not inode.isdigit() or int(inode) == 0:
        return None
    lo, _, hi = span.partition("-")
    try:
        return SharedMapping(start=int(lo, 16), end=int(hi, 16), perms=perms, offset=int(offset, 16), dev=dev,
                             inode=int(inode), path=parts[5].strip() if len(parts) > 5 else "")
    except ValueError:
        return None


def shared_file_mappings(pid: int, limit: int = MAX_SHARED_MAPPINGS) -> list[SharedMapping] | None:
    """The process's MAP_SHARED file mappings in address order; None when its maps cannot be read."""
    out: list[SharedMapping] = []
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                m = parse_maps_line(line)
                if m is not None:
                    out.append(m)
                    if len(out) >= limit:
                        break
    except OSError:
        return None
    return out


def mapping_at(mappings: list[SharedMapping], addr: int) -> SharedMapping | None:
    """The shared mapping that holds ``addr``."""
    return next((m for m in mappings if m.contains(addr)), None)


def read_head(pid: int, mapping: SharedMapping, size: int = 256) -> bytes | None:
    """The first ``size`` bytes of a shared mapping as the process sees them (/proc/PID/mem, read-only);
    None when the memory may not be read."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.pread(fd, min(size, mapping.end - mapping.start), mapping.start)
    except OSError:
        return None
    finally:
        os.close(fd)
