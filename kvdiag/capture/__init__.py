"""Capture stage: read-only evidence from live processes, one backend per tool behind a Protocol.

Entry points: :func:`capture_processes` (parallel, bounded, never raises for
tool trouble) and :func:`find_engine_processes` (which pid is the EngineCore).
"""

from kvdiag.capture.base import BackendResult, CaptureBackend, resolve_tool, run_tool
from kvdiag.capture.discover import classify_title, find_engine_processes, log_prefix_pids
from kvdiag.capture.orchestrate import (
    CAPTURE_SLACK_S,
    DEFAULT_BACKENDS,
    capture_processes,
    make_backends,
)
from kvdiag.capture.procfs import ProcBackend
from kvdiag.capture.tools import GdbBackend, PyspyBackend, PystackBackend
from kvdiag.capture.untouched import verify_untouched

__all__ = [
    "CAPTURE_SLACK_S", "DEFAULT_BACKENDS", "BackendResult", "CaptureBackend", "GdbBackend", "ProcBackend",
    "PyspyBackend", "PystackBackend", "capture_processes", "classify_title", "find_engine_processes", "log_prefix_pids",
    "make_backends", "resolve_tool", "run_tool", "verify_untouched",
]
