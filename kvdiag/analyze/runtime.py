"""Who can wake a thread inside a runtime the program runs in (Ray's core worker: grpc pollers, boost::asio
loops, absl and OpenTelemetry timers). Pure.

"Another thread might still release it" must name threads that can. A Python lock (threading.Lock) is
released only by code that runs in the interpreter. A thread that a native runtime started and that never
entered Python (a complete native stack: no Python frame, no interpreter entry, not waiting for the GIL)
cannot release one while it stays there; a Ray worker carries dozens of them, always in timed waits. And in
a Ray worker, the signal handlers are Ray's own (SIGTERM ends the worker): the main thread, blocked in the
program's lock, is not waiting for a handler to wake it.
"""

from __future__ import annotations

from kvdiag.analyze.classify import ThreadView, WaitKind

# Outermost frames of a thread whose stack was read to its start (an incomplete stack proves nothing).
_THREAD_ROOTS = ("start_thread", "clone", "__clone", "__clone3", "thread_start")
# Frames of the interpreter: a thread with one of these runs, or may return into, Python code.
_INTERPRETER = ("PyEval", "_PyEval", "PyGILState", "PyObject_Call", "_PyObject", "thread_run", "pythread_wrapper",
                "t_bootstrap", "Py_RunMain", "PyThread_acquire_lock", "take_gil", "PyCFunction", "cfunction_call")
# The Python module that runs a Ray worker's task loop on its main thread.
_RAY_WORKER_MAIN = ("ray/_private/workers/default_worker.py", "ray/_private/worker.py")


def native_runtime_thread(t: ThreadView) -> bool:
    """``t`` was started by native code and never entered the interpreter: it cannot release a Python lock."""
    frames = t.frames
    if not frames or t.kind is WaitKind.GIL_WAIT or any(f.kind == "python" for f in frames):
        return False
    if not any(f.name.startswith(_THREAD_ROOTS) for f in frames[-2:]):
        return False
    return not any(marker in f.name for f in frames for marker in _INTERPRETER)


def ray_worker_main(t: ThreadView) -> bool:
    """``t`` is the main thread of a Ray worker, running Ray's task loop (Ray's signal handlers, not the program's)."""
    return t.is_main and any(f.kind == "python" and (f.file or "").endswith(_RAY_WORKER_MAIN) and f.name == "main_loop"
                             for f in t.frames)


def may_release_python_lock(t: ThreadView, waiters: list[ThreadView]) -> bool:
    """Whether ``t`` (a possible signaller by the general rule) could still release a Python lock that one of
    ``waiters`` waits for."""
    if native_runtime_thread(t):
        return False
    return not (t in waiters and ray_worker_main(t))
