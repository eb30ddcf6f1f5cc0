"""Messages between the API server and EngineCore (pickled tuples over a multiprocessing pipe).

Tuples rather than classes: the output message is sent once per decode step and carries one
entry per running request, so its pickling cost matters.

API server -> EngineCore
  (ADD, rid, prompt_tokens, max_tokens, arrival_monotonic)
  (ABORT, rid)
EngineCore -> API server
  (READY, info)                        startup finished; info: dict of str -> str|int|float
  (OUTPUT, t, tokens, finished, stats) tokens: [(rid, token_id)], finished: [FinishedTuple],
                                       stats: dict | None; t: monotonic time of the step
  (STATS, t, stats)
  (ERROR, text)                        EngineCore is about to die of an exception
FinishedTuple = (rid, reason, scheduled_t, first_token_t, num_preemptions, num_tokens)
"""

from __future__ import annotations

import queue
from multiprocessing.connection import Connection
from typing import Any

ADD = "add"
ABORT = "abort"
READY = "ready"
OUTPUT = "out"
STATS = "stats"
ERROR = "error"

Message = tuple[Any, ...]
TokenTuple = tuple[int, int]
FinishedTuple = tuple[int, str, float, float, int, int]


def pump(source: queue.Queue[Message | None], conn: Connection) -> None:
    """Send every message ``source`` gives over the pipe, until None or until the pipe is closed."""
    while True:
        msg = source.get()
        if msg is None:
            return
        try:
            conn.send(msg)
        except (OSError, ValueError):
            return
