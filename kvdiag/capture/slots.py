"""Tool slots: how many ptrace tools run at once across all captured processes, and which goes next."""

from __future__ import annotations

import heapq
import itertools
import threading
import time


class ToolSlots:
    """At most ``n`` ptrace tools run at once, across all processes (one per CPU: more only makes each
    slower); a free slot goes to the most urgent waiting tool: (tool order, focus first), then first come.

    The processes outside the focus wait until every focus process's first ptrace tool (pystack: the
    verdict-critical one) has ended: it gets the machine to itself (on 2 cores that brought the EngineCore's
    verdict in 0.15 s sooner and cost the whole capture 0.4 s)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.busy = 0
        self.focus_left = 0     # focus processes whose first ptrace tool has not ended yet
        self._cond = threading.Condition()
        self._waiting: list[tuple[tuple[int, int], int]] = []
        self._seq = itertools.count()

    def add_focus(self) -> None:
        with self._cond:
            self.focus_left += 1

    def focus_done(self) -> None:
        with self._cond:
            self.focus_left = max(0, self.focus_left - 1)
            self._cond.notify_all()

    def _free(self, ticket: tuple[tuple[int, int], int]) -> bool:
        minor = ticket[0][1] > 0
        return (self.busy < self.n and self._waiting[0] == ticket) and not (minor and self.focus_left)

    def acquire(self, priority: tuple[int, int], timeout: float) -> bool:
        """Wait for a slot (bounded); False when ``timeout`` passed first. ``priority``: (tool order, rank)."""
        end = time.monotonic() + timeout
        with self._cond:
            ticket = (priority, next(self._seq))
            heapq.heappush(self._waiting, ticket)
            while not self._free(ticket):
                left = end - time.monotonic()
                if left <= 0:
                    self._waiting.remove(ticket)
                    heapq.heapify(self._waiting)
                    self._cond.notify_all()
                    return False
                self._cond.wait(left)
            heapq.heappop(self._waiting)
            self.busy += 1
            self._cond.notify_all()
            return True

    def release(self) -> None:
        with self._cond:
            self.busy -= 1
            self._cond.notify_all()
