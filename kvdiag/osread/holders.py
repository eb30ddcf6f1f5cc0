"""Which files a process holds, by identity: (st_dev, st_ino) of its file mappings and its open fds.

Names are not identities: a file renamed or unlinked after it was opened keeps showing its old name in
/proc/PID/maps and in fd links (glibc creates a named semaphore as ``sem.XXXXXX``, maps it, then links it
to its real name and unlinks the temporary one, so the mapping reads ``/dev/shm/sem.XXXXXX (deleted)``
while the file lives on as ``sem.mp-...``). The device and inode are what the process really holds.

No policy: callers say which devices they care about and decide what a holder means.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from kvdiag.osread.files import PROC, read_text

FileId = tuple[int, int]   # (st_dev, st_ino), as os.stat gives them


def file_id(path: str) -> FileId | None:
    """The identity of the file at ``path`` (the link itself, not followed); None when it is gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def device_of(path: str) -> int | None:
    """st_dev of the filesystem holding ``path`` (None when it does not exist)."""
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def _maps_dev(dev: int) -> str:
    """How /proc/PID/maps writes a device: ``major:minor`` in hex, at least two digits each."""
    return f"{os.major(dev):02x}:{os.minor(dev):02x}"


def mapped_ids(pid: int, devs: Collection[int]) -> set[FileId] | None:
    """Identities of the files on ``devs`` that ``pid`` maps (renamed or deleted ones included); None when
    its maps may not be read."""
    text = read_text(f"{PROC}/{pid}/maps")
    if text is None:
        return None
    wanted = {_maps_dev(d): d for d in devs}
    out: set[FileId] = set()
    for line in text.splitlines():
        if not any(f" {key} " in line for key in wanted):
            continue   # most lines (libraries, anonymous memory) are on other devices: skip the split
        parts = line.split(None, 5)
        if len(parts) >= 5 and parts[3] in wanted and parts[4].isdigit() and parts[4] != "0":
            out.add((wanted[parts[3]], int(parts[4])))
    return out


def fd_ids(pid: int, devs: Collection[int]) -> set[FileId] | None:
    """Identities of the files on ``devs`` that ``pid`` holds open (stat through /proc/PID/fd/N: the file
    itself, whatever its name now); None when its fd folder may not be read."""
    base = f"{PROC}/{pid}/fd/"
    try:
        fds = os.listdir(base)
    except OSError:
        return None
    out: set[FileId] = set()
    for fd in fds:
        try:
            if not os.readlink(base + fd).startswith("/"):
                continue   # a socket, pipe or anonymous inode: not a file on a filesystem
            st = os.stat(base + fd)
        except OSError:
            continue
        if st.st_dev in devs:
            out.add((st.st_dev, st.st_ino))
    return out


def held_ids(pid: int, devs: Collection[int]) -> set[FileId] | None:
    """Files on ``devs`` that ``pid`` maps or holds open; None when neither may be read (gone, or another
    user's process)."""
    mapped = mapped_ids(pid, devs)
    opened = fd_ids(pid, devs)
    if mapped is None and opened is None:
        return None
    return (mapped or set()) | (opened or set())
