"""The files a process has mapped (``/proc/PID/maps``): shared libraries and extension modules."""

from __future__ import annotations

from pathlib import Path


def mapped_files(pid: int, proc_root: Path = Path("/proc")) -> list[str]:
    """Absolute paths of the files mapped into ``pid``, each once, in map order; [] when unreadable."""
    try:
        text = (proc_root / str(pid) / "maps").read_text(errors="replace")
    except OSError:
        return []
    seen: dict[str, None] = {}
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            seen.setdefault(parts[5].removesuffix(" (deleted)"), None)
    return list(seen)
