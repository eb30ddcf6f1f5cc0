"""Follow an engine's log file as it grows (what its lines say is kvdiag.logs.lines')."""

from __future__ import annotations

from pathlib import Path

from kvdiag.logs.lines import LogState, feed_line


class LogFollower:
    """Reads complete new lines from a growing file without blocking."""

    def __init__(self, path: Path, max_line: int = 64 * 1024) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self._max_line = max_line

    def read_new(self, max_bytes: int = 4 * 1024 * 1024) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read(max_bytes)
        except FileNotFoundError:
            return []
        if not chunk:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        parts = data.split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > self._max_line:  # a runaway line without newline: flush it
            parts.append(self._partial)
            self._partial = b""
        return [p.decode("utf-8", errors="replace").rstrip("\r") for p in parts]


def scan_file(path: Path, source: str | None = None) -> LogState:
    """Read a whole log file into a LogState (used offline, e.g. by `kvdiag banner`)."""
    state = LogState()
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            feed_line(state, line.rstrip("\n"), source)
    return state
