"""Process helpers the integration tests share: tear a started process group down, wait for a condition with
a bound, find the reaper kvdiag handed a run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def kill_group(proc: subprocess.Popen[Any], timeout_s: float = 30.0) -> None:
    """SIGKILL the process group ``proc`` leads (the test started it with start_new_session), reap it and close
    its pipe."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=timeout_s)
    if proc.stdout is not None:
        proc.stdout.close()


def wait_for(cond: Callable[[], object], bound_s: float = 10.0, poll_s: float = 0.05) -> bool:
    """Poll ``cond()`` until true or the bound (which only stops a broken test from hanging)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return bool(cond())


def reaper_run_id(kvdiag_pid: int) -> str | None:
    """The run id kvdiag handed its reaper (``python -m kvdiag.launch.reaper RUN_ID GRACE KVDIAG_PID``)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = [a.decode() for a in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if "kvdiag.launch.reaper" in args and args[-1] == str(kvdiag_pid):
            return args[args.index("kvdiag.launch.reaper") + 1]
    return None
