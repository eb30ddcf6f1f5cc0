"""Every default a run's behaviour depends on, defined once (scenario fields, CLI flags and
analyzers import them from here), and the time source every timed wait reads (:data:`Clock`)."""

from __future__ import annotations

from collections.abc import Callable

# A time source, in seconds (``time.monotonic`` by default, ``time.time`` for wall-clock stamps); tests pass
# their own to step time without sleeping.
Clock = Callable[[], float]

STALL_WINDOW_S = 5.0        # no progress this long = a stall (startup: from the first log line)
STARTUP_TIMEOUT_S = 120.0   # per engine, to become ready
RUN_TIMEOUT_S = 300.0       # a whole scenario run
WATCH_WINDOW_S = 30.0       # kvdiag watch: a deployment's stall window (its steps can be long)
DEFAULT_PROBE_PERIOD_S = 30.0       # watch --probe: seconds of idleness before a canary, and at least between two
POLL_S = 0.25               # watcher poll period
KILL_GRACE_S = 5.0          # SIGTERM -> SIGKILL at teardown
TOOL_TIMEOUT_S = 15.0       # one capture tool on one process
SWEEP_STALL_WINDOW_S = 2.0  # a sweep cell's stall window: the capture's stacks decide the verdict, not the window
SWEEP_MAX_JOBS = 4          # runs in parallel by default: min(CPUs + 1, this)
# Capture tools, in the order they run: /proc first (it never pauses the target and opens the progress
# window), then the stack tools.
DEFAULT_TOOLS = ("proc", "py-spy", "pystack", "gdb")
# KV pool usage at or above this share is full: with requests running and no tokens, a decode stall; in a
# soak, the load saturated the pool.
KV_FULL = 0.9
# A simulated engine's tokens per KV page and vLLM block size when its flags give none (what doctor plans).
SIM_TOKENS_PER_PAGE = 2048
SIM_BLOCK_SIZE = 16

# A main thread with at least this long left to sleep is not what completes a wait the capture found stuck: what it
# does after waking cannot explain the stall the user sees now.
LONG_SLEEP_S = 60.0
