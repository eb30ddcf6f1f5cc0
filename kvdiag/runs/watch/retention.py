"""The watch's output folder: one report folder per capture, the oldest removed beyond ``keep``.

Only folders this module named (``stall-<engine>-<stamp>-<hex>``) and that hold a ``bundle/``
are ever removed: anything else a user put under --out stays.
"""

from __future__ import annotations

import re
import secrets
import shutil
from datetime import datetime
from pathlib import Path

PREFIX = "stall-"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def capture_dir(out: Path, engine: str, now: datetime | None = None) -> Path:
    """A fresh folder name under ``out`` for one capture of ``engine`` (not created)."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return out / f"{PREFIX}{_SAFE.sub('_', engine)[:60]}-{stamp}-{secrets.token_hex(2)}"


def watch_captures(out: Path) -> list[Path]:
    """The capture folders under ``out``, oldest first."""
    try:
        found = [p for p in out.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "bundle").is_dir()]
    except OSError:
        return []
    return sorted(found, key=lambda p: (p.stat().st_mtime, p.name))


def prune(out: Path, keep: int) -> list[Path]:
    """Remove the oldest capture folders so that at most ``keep`` remain; returns what was removed."""
    if keep < 0:
        return []
    found = watch_captures(out)
    gone = found[: max(0, len(found) - keep)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


__all__ = ["PREFIX", "capture_dir", "prune", "watch_captures"]
