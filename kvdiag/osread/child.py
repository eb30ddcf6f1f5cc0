"""A bounded child process for the environment's queries (GPUs, an engine's interpreter).

The child runs in its own process group, so that a timeout (or an interrupt) ends it and
anything it started (an ``nvidia-smi``), and it is always reaped.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence


class ChildTimeout(Exception):
    """The child did not finish within its bound (it and its group were killed)."""


def run_bounded(argv: Sequence[str], timeout_s: float) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of ``argv`` run to completion within ``timeout_s``.

    Raises OSError when it cannot start and :class:`ChildTimeout` when it runs too long."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ChildTimeout(f"no answer within {timeout_s:g}s") from None
    except BaseException:
        _kill_group(proc)
        raise
    return proc.returncode, out, err


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass
