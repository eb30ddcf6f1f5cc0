"""Whole-file reads of /proc and /sys that never raise: a file that is gone or refused reads as None."""

from __future__ import annotations

import os
from pathlib import Path

PROC = "/proc"


def read_text(path: str | Path) -> str | None:
    """A /proc (or /sys) file's text, or None when it is gone or refused."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def read_bytes(path: str | Path) -> bytes | None:
    """A /proc file's raw bytes (NUL-separated files: cmdline, environ), or None when gone or refused."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def read_link(path: str | Path) -> str | None:
    """The target of a /proc symlink (exe, cwd, fd/N), or None when it is gone or refused."""
    try:
        return os.readlink(path)
    except OSError:
        return None


def list_numeric(path: str | Path) -> list[int] | None:
    """The numeric entries of a /proc folder (pids, tids, fds), sorted; None when it cannot be listed."""
    try:
        return sorted(int(name) for name in os.listdir(path) if name.isdigit())
    except OSError:
        return None
