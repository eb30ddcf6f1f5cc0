"""The target's memory, read through /proc/PID/mem: never stops it (no ptrace attach)."""

from __future__ import annotations

import os

from kvdiag.osread.files import PROC


def mem_open_error(pid: int) -> OSError | None:
    """Open /proc/PID/mem read-only (the kernel runs its ptrace-attach check); None when allowed."""
    try:
        fd = os.open(f"{PROC}/{pid}/mem", os.O_RDONLY)
    except OSError as exc:
        return exc
    os.close(fd)
    return None


class TargetMemory:
    """Read-only access to another process's memory; never stops it."""

    def __init__(self, pid: int) -> None:
        self._fd: int | None = None
        try:
            self._fd = os.open(f"{PROC}/{pid}/mem", os.O_RDONLY)
        except OSError:
            self._fd = None

    @property
    def ok(self) -> bool:
        return self._fd is not None

    def read(self, addr: int, size: int) -> bytes | None:
        """``size`` bytes at ``addr``; None when unmapped, refused or short."""
        if self._fd is None or addr <= 0:
            return None
        try:
            data = os.pread(self._fd, size, addr)
        except (OSError, OverflowError, ValueError):
            return None
        return data if len(data) == size else None

    def read_upto(self, addr: int, size: int) -> bytes | None:
        """Up to ``size`` bytes at ``addr`` (fewer at the end of a mapping); None when refused."""
        if self._fd is None:
            return None
        try:
            return os.pread(self._fd, size, addr)
        except (OSError, OverflowError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
