"""What frames, wchans and syscalls mean: the vocabulary the classifier matches against.

Native names are normalised before matching (``___pthread_cond_wait``,
``pthread_cond_wait@@GLIBC_2.3.2`` and ``__GI___pthread_cond_wait`` are all
``pthread_cond_wait``). C++ and binding-library names are matched by
substring (``pybind11::gil_scoped_acquire::gil_scoped_acquire()``).
"""

from __future__ import annotations

import functools
import os
import re
import sys

from kvdiag.model.evidence import Frame
from kvdiag.osread.syscall import FUTEX_WCHANS

_SUFFIX = re.compile(r"(@@?GLIBC[\w.]*|\.constprop\.\d+|\.isra\.\d+|\.part\.\d+|\.cold)+$")


@functools.lru_cache(maxsize=8192)
def norm(name: str) -> str:
    """Canonical native function name for matching (the same few hundred names recur in every stack)."""
    n = _SUFFIX.sub("", name.strip())
    if n.startswith("__GI_"):
        n = n[len("__GI_"):]
    n = n.lstrip("_")
    if n.endswith("64") and n[:-2] in _STRIP64:
        n = n[:-2]
    return n


_STRIP64 = {"pthread_cond_timedwait", "pthread_cond_wait", "futex_abstimed_wait_cancelable",
            "futex_abstimed_wait_common", "new_sem_wait_slow", "pthread_mutex_timedlock",
            "clock_nanosleep", "pread", "sem_timedwait", "pthread_cond_clockwait"}

# Taking the GIL. take_gil is static (invisible in stripped interpreters); the public entry
# points and the binding libraries' guards stay named.
GIL_ACQUIRE = frozenset({"take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "PyEval_AcquireLock",
                         "PyGILState_Ensure", "PyEval_AcquireLockTstate", "PyThread_acquire_gil"})
GIL_ACQUIRE_SUBSTR = ("gil_scoped_acquire", "GILGuard::acquire", "ensure_gil", "acquire_gil",
                      "PyGILState_Ensure")
# Frames that mean "the thread is inside the interpreter": the innermost blocking story ends here.
EVAL_FRAMES = frozenset({"PyEval_EvalFrameDefault", "PyEval_EvalFrame", "PyEval_Vector", "PyEval_EvalCode",
                         "PyObject_Vectorcall", "PyObject_VectorcallTstate", "PyObject_Call",
                         "PyObject_MakeTpCall", "method_vectorcall", "cfunction_vectorcall_O",
                         "cfunction_vectorcall_FASTCALL", "cfunction_vectorcall_FASTCALL_KEYWORDS",
                         "method_vectorcall_VARARGS_KEYWORDS", "method_vectorcall_FASTCALL",
                         "method_vectorcall_NOARGS", "method_vectorcall_O", "PyCFuncPtr_call",
                         "ctypes_callproc", "call_function_pointer", "thread_run", "pythread_wrapper"})

COND_WAIT = frozenset({"pthread_cond_wait", "pthread_cond_timedwait", "pthread_cond_clockwait",
                       "pthread_cond_wait_common", "cnd_wait", "cnd_timedwait"})
COND_WAIT_SUBSTR = ("condition_variable::wait", "condition_variable::__wait", "condition_variable_any::wait",
                    "condition_variable::_M_wait", "__condvar_")
MUTEX_WAIT = frozenset({"lll_lock_wait", "lll_lock_wait_private", "pthread_mutex_lock", "pthread_mutex_timedlock",
                        "pthread_mutex_clocklock", "pthread_mutex_lock_full", "lll_robust_lock_wait",
                        "pthread_rwlock_rdlock", "pthread_rwlock_wrlock", "mtx_lock",
                        "pthread_mutex_cond_lock", "pthread_mutex_lock_slow"})
MUTEX_WAIT_SUBSTR = ("std::mutex::lock", "gthread_mutex_lock", "std::recursive_mutex::lock",
                     "std::timed_mutex", "std::shared_mutex::lock")
# Python-level locks (threading.Lock, Condition, Event, Queue, join): a semaphore wait, GIL released.
PY_LOCK_WAIT = frozenset({"PyThread_acquire_lock_timed", "acquire_timed", "lock_PyThread_acquire_lock",
                          "rlock_acquire", "PyThread_acquire_lock", "sem_wait", "sem_timedwait",
                          "sem_clockwait", "new_sem_wait", "new_sem_wait_slow", "do_futex_wait"})
IO_READ = frozenset({"read", "libc_read", "recv", "libc_recv", "recvfrom", "libc_recvfrom", "recvmsg",
                     "libc_recvmsg", "readv", "pread", "recvmmsg", "os_read", "Py_read", "sock_recv",
                     "sock_recv_into", "sock_recvfrom", "sock_recvfrom_into", "sock_recvmsg",
                     "sock_recv_impl", "sock_recvfrom_impl", "sock_call_ex", "sock_call", "io_read",
                     "FileIO_read", "fileio_readinto", "buffered_read", "readexactly"})
EVENT_WAIT = frozenset({"poll", "ppoll", "epoll_wait", "epoll_pwait", "epoll_pwait2", "select", "pselect",
                        "pselect6", "accept", "accept4", "zmq_poll", "select_poll_poll_impl", "select_poll_poll",
                        "select_epoll_poll_impl", "select_epoll_poll", "select_select_impl", "select_select",
                        "sock_accept", "sock_accept_impl", "kevent", "pause", "sigsuspend", "sigwait",
                        "sigtimedwait", "sigwaitinfo", "signal_pause", "signal_sigwait", "uv_run"})
SLEEP = frozenset({"nanosleep", "clock_nanosleep", "time_sleep", "pysleep", "usleep", "sleep",
                   "thrd_sleep", "std::this_thread::sleep_for"})
SPIN = frozenset({"sched_yield", "os_sched_yield"})
# Waiting for another thread to exit (a futex wait on its TID).
JOIN_WAIT = frozenset({"pthread_join", "pthread_clockjoin_ex", "pthread_timedjoin_np", "pthread_join_common",
                       "thrd_join", "std::thread::join"})

# Python frames by (file basename, function) that say what kind of wait this is.
PY_FRAME_KINDS: dict[tuple[str, str], str] = {
    ("threading.py", "wait"): "py_cond", ("threading.py", "Condition.wait"): "py_cond",
    ("threading.py", "Event.wait"): "py_cond", ("queue.py", "get"): "py_cond", ("queue.py", "Queue.get"): "py_cond",
    ("threading.py", "join"): "join", ("threading.py", "Thread.join"): "join",
    ("threading.py", "_wait_for_tstate_lock"): "join", ("threading.py", "Thread._wait_for_tstate_lock"): "join",
    ("streams.py", "readexactly"): "read", ("streams.py", "StreamReader.readexactly"): "read",
    ("streams.py", "readuntil"): "read", ("connection.py", "_recv"): "read",
    ("connection.py", "Connection._recv"): "read", ("socket.py", "recv_into"): "read",
    ("socket.py", "readinto"): "read", ("socket.py", "SocketIO.readinto"): "read",
    ("selectors.py", "select"): "event", ("selectors.py", "_PollLikeSelector.select"): "event",
    ("selectors.py", "EpollSelector.select"): "event", ("base_events.py", "_run_once"): "event",
    ("socketserver.py", "serve_forever"): "event", ("connection.py", "wait"): "event",
}

# Kernel wait channels.
WCHAN_FUTEX = FUTEX_WCHANS
WCHAN_READ = ("unix_stream_read_generic", "unix_stream_data_wait", "sk_wait_data", "pipe_read",
              "anon_pipe_read", "pipe_wait", "pipe_wait_readable", "tcp_recvmsg", "wait_woken",
              "__skb_wait_for_more_packets", "skb_wait_for_more_packets", "unix_dgram_recvmsg")
WCHAN_SOCKET_READ = ("unix_stream_read_generic", "unix_stream_data_wait", "sk_wait_data", "tcp_recvmsg",
                     "skb_wait_for_more_packets", "unix_dgram_recvmsg")
WCHAN_TTY = ("n_tty_read", "tty_read")
WCHAN_EVENT = ("do_epoll_wait", "ep_poll", "poll_schedule_timeout", "do_select", "core_sys_select",
               "do_sys_poll", "inet_csk_accept", "unix_accept", "sigsuspend", "do_sigtimedwait",
               "sys_pause", "do_sys_pause")
WCHAN_SLEEP = ("hrtimer_nanosleep", "do_nanosleep", "clock_nanosleep")

# Threads that sit idle by design (pools, monitors, library I/O threads): never a hang by themselves.
IDLE_THREAD_NAMES = re.compile(
    r"^(ZMQbg/|gloo_tcp_loop|pt_gloo_runloop|tqdm_monitor|DeathPipeMonitor|MultiprocWorkerMonitor|MPClientEngineMonitor|"
    r"signal-callback|cuda-EvtHandlr|cuda0|pt_autograd|jemalloc_bg_thd|QueueFeederThread|"
    r"Thread-\d+ \(_handle_(workers|tasks|results)\)|OMP|omp_|IPC listener|asyncio_\d+)")
IDLE_FRAME_NAMES = frozenset({"blas_thread_server", "gomp_thread_start", "gomp_team_barrier_wait_end",
                              "gomp_simple_barrier_wait", "TMonitor.run", "_handle_workers", "_handle_tasks",
                              "_handle_results", "death_pipe_monitor", "monitor_workers", "_feed",
                              "Queue._feed", "_python_exit", "cuEventSynchronize_monitor"})
IDLE_FRAME_SUBSTR = ("__kmp_", "blas_thread", "gloo::", "zmq::", "tqdm/_monitor", "monitor_death_pipe",
                     "start_worker_monitor", "resource_tracker",
                     "monitor_engine_liveness")   # vLLM: waits on process sentinels for a child's death
# (last two path components, function) of Python frames that are a worker's wait for its next task.
IDLE_PY_FRAMES = frozenset({(("multiprocessing", "pool.py"), "worker")})
# What a blocked read is for, from the Python frames alone (used where /proc's fd peers are missing).
# (last two path components, function). A read under one of these waits for the next request or task:
# the server end of a connection, a worker's loop. Written from how the standard library's servers and
# pools idle, not from any test program.
REQUEST_WAIT_PY_FRAMES = frozenset({
    (("socketserver.py",), "serve_forever"), (("socketserver.py",), "handle"),
    (("socketserver.py",), "finish_request"), (("socketserver.py",), "process_request_thread"),
    (("http", "server.py"), "handle_one_request"), (("http", "server.py"), "handle"),
    (("wsgiref", "simple_server.py"), "handle"),
    (("multiprocessing", "managers.py"), "serve_client"), (("multiprocessing", "managers.py"), "accepter"),
    (("multiprocessing", "managers.py"), "handle_request"),
    (("multiprocessing", "pool.py"), "worker"),
    (("futures", "process.py"), "_process_worker"), (("futures", "thread.py"), "_worker"),
})
# A read under one of these waits for a reply to a request it sent (a client call), or for the results
# of the workers this process started.
REPLY_WAIT_PY_FRAMES = frozenset({
    (("http", "client.py"), "getresponse"), (("http", "client.py"), "begin"),
    (("http", "client.py"), "_read_status"),
    (("xmlrpc", "client.py"), "single_request"), (("xmlrpc", "client.py"), "parse_response"),
    (("multiprocessing", "managers.py"), "_callmethod"), (("multiprocessing", "managers.py"), "dispatch"),
    (("multiprocessing", "connection.py"), "answer_challenge"),
    (("multiprocessing", "connection.py"), "deliver_challenge"),
    (("urllib3", "connectionpool.py"), "_make_request"), (("redis", "connection.py"), "read_response"),
    (("redis", "client.py"), "parse_response"), (("grpc", "_channel.py"), "_blocking"),
    (("grpc", "_channel.py"), "__call__"),
})
# Function names client libraries give the read of a reply (redis-py and its kin: read_response;
# http.client/urllib3: getresponse), matched in any file.
REPLY_WAIT_FUNCS = frozenset({"read_response", "getresponse", "read_reply", "recv_reply", "_read_reply"})
# A process started by multiprocessing (fork or spawn): its channels come from its parent.
MP_CHILD_PY_FRAMES = frozenset({(("multiprocessing", "process.py"), "_bootstrap"),
                                (("multiprocessing", "spawn.py"), "_main")})
# multiprocessing's own channels: a Connection (Pipe) or a Queue.
MP_CHANNEL_FILES = (("multiprocessing", "connection.py"), ("multiprocessing", "queues.py"))


def py_frame_key(frame: Frame) -> tuple[tuple[str, ...], str]:
    """(last two path components, bare function name) of a Python frame."""
    parts = tuple((frame.file or "").rsplit("/", 2)[-2:])
    return parts, frame.name.rsplit(".", 1)[-1]


def py_frame_in(frame: Frame, table: frozenset[tuple[tuple[str, ...], str]]) -> bool:
    """``frame`` is one of ``table``'s (path tail, function) entries (a one-component tail matches any folder)."""
    if frame.kind != "python":
        return False
    parts, name = py_frame_key(frame)
    return (parts, name) in table or ((parts[-1],) if parts else (), name) in table


# A worker's loop taking its next task from a queue (the standard library's pools and queues): a wait here is
# for new work, whatever lock the queue blocks on underneath.
TASK_QUEUE_FRAMES = frozenset({
    (("queue.py",), "get"), (("multiprocessing", "queues.py"), "get"), (("futures", "thread.py"), "_worker"),
    (("multiprocessing", "pool.py"), "worker"), (("futures", "process.py"), "_process_worker"),
})


IDLE_PROCESS_MARKERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
                        "multiprocessing.semaphore_tracker")


def is_eval_boundary(frame: Frame) -> bool:
    return frame.kind == "python" or norm(frame.name) in EVAL_FRAMES


def innermost_segment(frames: list[Frame]) -> list[Frame]:
    """Frames from the innermost up to (excluding) the first Python or interpreter-eval frame."""
    out: list[Frame] = []
    for f in frames:
        if is_eval_boundary(f):
            break
        out.append(f)
    return out


@functools.lru_cache(maxsize=32768)   # pure, and called for every frame of every thread with the same few vocabularies
def matches(name: str, exact: frozenset[str], substr: tuple[str, ...] = ()) -> bool:
    n = norm(name)
    return n in exact or name in exact or any(s in name for s in substr)


def python_kind(frame: Frame) -> str | None:
    """Meaning of a Python frame (py-spy writes Class.method, pystack only the function)."""
    if frame.kind != "python":
        return None
    base = os.path.basename(frame.file or "")
    return PY_FRAME_KINDS.get((base, frame.name)) or PY_FRAME_KINDS.get((base, frame.name.rsplit(".", 1)[-1]))


def _drop_brackets(text: str, opening: str, closing: str, keep: str) -> str:
    if opening not in text:   # nothing to drop (a closing bracket alone is kept)
        return text
    out: list[str] = []
    depth = 0
    for ch in text:
        if ch == opening:
            if depth == 0:
                out.append(keep)
            depth += 1
        elif ch == closing and depth > 0:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def short_name(name: str, limit: int = 100, components: int = 0) -> str:
    """Readable C++ name: templates and parameter lists dropped when long; optionally only the
    last ``components`` scopes (``PageAllocator::map_pages``)."""
    if len(name) > limit or components:
        name = _drop_brackets(name, "<", ">", "")
        name = _drop_brackets(name, "(", ")", "()")
        name = name.replace("{lambda()#", "{lambda#")
    if components:
        name = "::".join(name.split("::")[-components:])
    return name


def describe(frame: Frame) -> str:
    """Short human form of a frame for evidence: ``alloc_page (gil_cycle.c:66)``."""
    name = short_name(frame.name)
    if frame.file and frame.line:
        return f"{name} ({os.path.basename(frame.file)}:{frame.line})"
    if frame.library:
        return f"{name} ({os.path.basename(frame.library)})"
    return name


_SYSTEM_LIBS = ("libc.", "libc-", "libpython", "libffi", "libstdc++", "libpthread", "ld-linux", "libgcc",
                "python3", "python2", "_ctypes", "libm.", "libdl.", "librt.")
_SYSTEM_SRC = re.compile(r"(^|/)(Python|Objects|Modules|Include|Parser|Programs)/|(^|/)\.{0,2}/?(nptl|sysdeps|csu|"
                         r"misc|posix|stdlib|string|elf)/|/lib-dynload/|python-build")
_SYSTEM_PREFIXES = ("futex", "PyCOND", "PyMUTEX", "Py", "pthread_", "clone", "start_thread", "libc_start")
WAIT_PRIMITIVES = (GIL_ACQUIRE | COND_WAIT | MUTEX_WAIT | PY_LOCK_WAIT | IO_READ | EVENT_WAIT | SLEEP | SPIN
                    | EVAL_FRAMES | JOIN_WAIT)


_BINDING_GLUE = ("nanobind::detail::", "nanobind::gil_scoped", "nanobind::cpp_function", "pybind11::detail::",
                 "pybind11::gil_scoped", "pybind11::cpp_function", "nb::detail::", "std::function<", "std::_Function",
                 "std::__invoke", "std::thread::_State", "std::thread::_Invoker", "execute_native_thread_routine")


# The C++ standard library: never "the project's" frame, whatever library it was inlined into.
_STL = ("std::", "__gnu_cxx::", "__cxxabiv1::", "__cxx11::")


@functools.lru_cache(maxsize=8192)   # the same native frames recur in every thread of a process and every analysis
def _qualified(name: str) -> str:
    """``std::__invoke_impl`` from ``bool std::__invoke_impl<bool, ...>(...)``: the name without its
    return type, template arguments and parameters."""
    bare = _drop_brackets(_drop_brackets(name, "<", ">", ""), "(", ")", "")
    return bare.split()[-1] if bare.split() else bare


def is_binding_glue(frame: Frame) -> bool:
    """pybind11/nanobind/std::function plumbing between Python and the application's C++."""
    return frame.kind == "native" and frame.name.startswith(_BINDING_GLUE)


def is_system_frame(frame: Frame) -> bool:
    """libc, the interpreter, binding glue, wait primitives and unnamed frames: not the application's code."""
    if frame.kind == "python":
        return False
    if frame.name.startswith(_BINDING_GLUE) or _qualified(frame.name).startswith(_STL):
        return True
    if frame.name in ("???", "??", "") or frame.name.startswith("0x"):
        return True
    n = norm(frame.name)
    if n in WAIT_PRIMITIVES or n in ("start", "main") or n.startswith(_SYSTEM_PREFIXES):
        return True
    lib = os.path.basename(frame.library or "")
    if lib and lib.startswith(_SYSTEM_LIBS):
        return True
    return bool(frame.file and _SYSTEM_SRC.search(frame.file))


# Call plumbing that is not the project's logic either: libffi/ctypes, and kvdiag's own binding bridge
# (its model allocator then reads exactly like kvcached's pybind11 build).
CALL_GLUE = ("ffi_", "_ctypes", "PyCFuncPtr", "kvdiag::bindings::")
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"threading", "asyncio", "selectors", "socket",
                                                                   "queue", "concurrent", "multiprocessing"}


def is_stdlib_python(frame: Frame) -> bool:
    """A Python frame of the standard library (threading.py, multiprocessing/connection.py, ...)."""
    file = frame.file or ""
    if "site-packages" in file or "dist-packages" in file:
        return False
    if re.search(r"/lib/python3[\d.]*/", file):
        return True
    mod = os.path.basename(file).removesuffix(".py")
    return bool(mod) and "/" not in file and mod in _STDLIB


def is_project_frame(frame: Frame) -> bool:
    """The application's own code: a Python frame outside the standard library, or a named native
    frame that is not libc, the interpreter, the C++ standard library or call/binding glue."""
    if frame.kind == "python":
        return not is_stdlib_python(frame)
    return not is_system_frame(frame) and not frame.name.startswith(CALL_GLUE)


def library_key(frame: Frame) -> str | None:
    """``gil_cycle`` for /tmp/x/gil_cycle-3f82.so or .../gil_cycle.c: groups frames of one component."""
    src = frame.library or frame.file
    if not src or frame.kind == "python":
        return None
    return os.path.basename(src).split(".")[0].split("-")[0] or None
