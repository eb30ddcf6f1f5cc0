"""The local processes of a watched server: its API server and EngineCore, as /proc shows them.

Finding them (the port's listener, the EngineCore under it) costs a walk of every socket on the
host, so it is done when the watch starts, when a known process is gone, and otherwise at most
every ``relocate_s`` while none is known (a server still starting). Each look then reads only the
EngineCore's /proc/PID/stat and wchan. Nothing here signals or attaches to a process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvdiag.capture.locate import Located
from kvdiag.defaults import Clock
from kvdiag.osread.ptable import alive
from kvdiag.osread.stat import read_stat
from kvdiag.osread.tasks import read_wchan
from kvdiag.watch.reading import CoreSample


def sample_core(pid: int) -> CoreSample | None:
    """State, main-thread wchan and CPU ticks of ``pid``; None when it is gone."""
    st = read_stat(pid)
    if st is None or st.state in ("Z", "X"):
        return None
    return CoreSample(pid=pid, state=st.state, wchan=read_wchan(pid), cpu_ticks=st.utime + st.stime)


@dataclass
class LocalEngine:
    """Keeps the pids of one server current; ``locate()`` is the (costly) discovery."""

    locate: Callable[[], Located]
    clock: Clock
    relocate_s: float = 5.0
    server_pid: int | None = None
    core_pid: int | None = None
    note: str | None = None
    _last_locate: float | None = None

    def refresh(self, force: bool = False) -> None:
        now = self.clock()
        gone = (self.core_pid is not None and not alive(self.core_pid)) or \
            (self.server_pid is not None and not alive(self.server_pid))
        missing = self.core_pid is None
        due = self._last_locate is None or now - self._last_locate >= self.relocate_s
        if force or gone or (missing and due):
            self._last_locate = now
            found = self.locate()
            self.server_pid, self.core_pid, self.note = found.server_pid, found.core_pid, found.note

    def sample(self) -> tuple[int | None, CoreSample | None]:
        """(API server pid, EngineCore sample) now; rediscovers when a known process is gone."""
        self.refresh()
        core = sample_core(self.core_pid) if self.core_pid is not None else None
        if core is None and self.core_pid is not None:
            self.refresh(force=True)
            core = sample_core(self.core_pid) if self.core_pid is not None else None
        return self.server_pid, core


__all__ = ["LocalEngine", "sample_core"]
