"""/proc/locks: every file lock the kernel holds (flock, POSIX record locks, OFD locks) and who waits for one."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.osread.files import PROC, read_text


@dataclass(frozen=True)
class FileLock:
    """One line of /proc/locks. ``waiting``: a ``->`` line, a request blocked behind the lock above it."""

    kind: str            # FLOCK, POSIX, OFDLCK, LEASE, ...
    access: str          # READ, WRITE
    pid: int | None      # the holder (or waiter); None for OFD locks, which belong to an open file, not a process
    major: int
    minor: int
    inode: int
    start: str
    end: str
    waiting: bool

    def same_file(self, major: int, minor: int, inode: int) -> bool:
        return (self.major, self.minor, self.inode) == (major, minor, inode)


def parse_locks(text: str) -> list[FileLock]:
    """``1: FLOCK  ADVISORY  WRITE 4242 00:1b:1234 0 EOF`` (waiters: ``1: -> FLOCK ...``)."""
    out: list[FileLock] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        waiting = parts[1] == "->"
        fields = parts[2:] if waiting else parts[1:]
        if len(fields) < 7:
            continue
        kind, _mode, access, pid_s, dev, start, end = fields[:7]
        dev_parts = dev.split(":")
        if len(dev_parts) != 3:
            continue
        try:
            major, minor, inode = int(dev_parts[0], 16), int(dev_parts[1], 16), int(dev_parts[2])
            pid = int(pid_s)
        except ValueError:
            continue
        out.append(FileLock(kind=kind, access=access, pid=pid if pid > 0 else None, major=major, minor=minor,
                            inode=inode, start=start, end=end, waiting=waiting))
    return out


def read_locks() -> list[FileLock] | None:
    """Every lock in /proc/locks; None when it cannot be read."""
    text = read_text(f"{PROC}/locks")
    return None if text is None else parse_locks(text)
