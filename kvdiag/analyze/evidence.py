"""Evidence for a verdict: the frames a thread is cited with, and which of them the rule rests on.

A rule cites a thread with the frames from its deciding wait up to its second Python frame
(:func:`cite`), and names the few of them its conclusion rests on (:class:`Key`): the blocking
primitive, the GIL acquire, the first project frame, the Python call that entered it. Renderers
highlight only those. The same project-frame notion names the place in a summary (:func:`where`).
Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

from kvdiag.analyze import vocab as v
from kvdiag.analyze.classify import ThreadView
from kvdiag.model.evidence import Frame
from kvdiag.model.verdict import EvidenceItem
from kvdiag.model.waits import FrameRef

CITE_LIMIT = 12


class Key(Enum):
    """A kind of frame a rule's conclusion rests on."""

    WAIT = "wait"          # the blocking primitive the thread is parked in (pthread_cond_wait, recv, ...)
    GIL = "gil"            # the call that waits to take the GIL (PyGILState_Ensure, take_gil, ...)
    PROJECT = "project"    # the first frame of the application's own code (PageAllocator::alloc_page)
    CALLER = "caller"      # the Python call that entered that native project frame


# What each kind of evidence rests on; every rule picks one of these for each thread it cites.
HOLDER_KEYS = (Key.WAIT, Key.PROJECT, Key.CALLER)   # blocked while holding the GIL
GIL_WAITER_KEYS = (Key.GIL, Key.PROJECT)            # waits for the GIL, from where
BLOCKED_KEYS = (Key.WAIT, Key.PROJECT)              # parked in a lock/condvar/read, from where
CONTEXT_KEYS = (Key.WAIT,)                          # "also blocked": only that it waits counts

# The public blocking calls: of a run of libc aliases (__pthread_cond_wait_common →
# pthread_cond_wait, __libc_recv → __recv) the outermost of these is the call the code made.
PUBLIC_WAITS = frozenset({
    "pthread_cond_wait", "pthread_cond_timedwait", "pthread_cond_clockwait", "cnd_wait", "cnd_timedwait",
    "pthread_mutex_lock", "pthread_mutex_timedlock", "pthread_mutex_clocklock", "pthread_rwlock_rdlock",
    "pthread_rwlock_wrlock", "mtx_lock",
    "PyThread_acquire_lock_timed", "acquire_timed", "lock_PyThread_acquire_lock", "rlock_acquire",
    "PyThread_acquire_lock",
    "read", "libc_read", "recv", "libc_recv", "recvfrom", "libc_recvfrom", "recvmsg", "libc_recvmsg", "readv",
    "pread", "recvmmsg",
    "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select", "pselect", "pselect6", "accept",
    "accept4", "pause", "sigsuspend", "sigwait", "sigtimedwait", "sigwaitinfo", "zmq_poll", "kevent",
    "nanosleep", "clock_nanosleep", "usleep", "sleep",
    "pthread_join", "pthread_clockjoin_ex", "pthread_timedjoin_np", "thrd_join",
    "sem_wait", "sem_timedwait", "sem_clockwait",
})


def _is_wrapper(f: Frame) -> bool:
    """Functor/lambda call operators wrap the named function under them, which says more."""
    return f.name.endswith("operator()") or "operator() const" in f.name or "{lambda" in f.name


def is_named_project_frame(f: Frame) -> bool:
    return v.is_project_frame(f) and not _is_wrapper(f) and f.name not in ("???", "??", "")


def _start(view: ThreadView) -> int:
    """Index of the deciding wait frame (where a citation starts)."""
    frames = view.frames
    start = next((i for i, f in enumerate(frames) if view.wait_frame and f.name == view.wait_frame), None)
    if start is None:
        start = next((i for i, f in enumerate(frames) if v.norm(f.name) in v.WAIT_PRIMITIVES), 0)
    return start


def frame_rows(frames: list[Frame], start: int, skip: Callable[[int, Frame, bool], bool],
               text: Callable[[Frame], str] = v.describe, limit: int | None = None) -> list[tuple[int, str]]:
    """(frame index, text) of the frames a citation shows: from ``start`` out to the second Python frame,
    a line repeated by the next frame once, without the frames ``skip(index, frame, past a Python frame)``
    leaves out; at most ``limit`` rows."""
    rows: list[tuple[int, str]] = []
    python_seen = 0
    for i in range(start, len(frames)):
        f = frames[i]
        if skip(i, f, python_seen > 0):
            continue
        line = text(f)
        if rows and rows[-1][1] == line:
            continue
        rows.append((i, line))
        if f.kind == "python":
            python_seen += 1
            if python_seen >= 2:
                break
        if limit is not None and len(rows) >= limit:
            break
    return rows


def _cited(view: ThreadView, limit: int = CITE_LIMIT) -> list[tuple[int, str]]:
    """(frame index, text) of the cited frames: from the deciding wait frame up to the second Python
    frame, without libc internals, binding glue or unnamed frames."""

    def skip(_i: int, f: Frame, past_python: bool) -> bool:
        return (f.name in ("???", "??")
                # interpreter internals between Python frames add nothing
                or (past_python and f.kind != "python")
                or (v.is_binding_glue(f) and not v.matches(f.name, v.GIL_ACQUIRE, v.GIL_ACQUIRE_SUBSTR)))

    return frame_rows(view.frames, _start(view), skip, limit=limit)


def cite(view: ThreadView, limit: int = CITE_LIMIT) -> list[str]:
    """The frames that prove what the thread waits in, innermost first."""
    return [text for _, text in _cited(view, limit)]


def _outermost_run(frames: list[Frame], indices: Sequence[int], first: int, pred: Callable[[Frame], bool]) -> int:
    """From ``first`` (a position in ``indices``), the frame index of the last consecutive one that matches:
    of ``__pthread_cond_wait_common ← pthread_cond_wait``, the call the code made."""
    last = first
    for pos in range(first + 1, len(indices)):
        if not pred(frames[indices[pos]]):
            break
        last = pos
    return indices[last]


def _public_wait(f: Frame) -> bool:
    return f.kind != "python" and v.norm(f.name) in PUBLIC_WAITS


def _py_wait(f: Frame) -> bool:
    return v.python_kind(f) is not None


def _gil_exact(f: Frame) -> bool:
    return f.kind != "python" and (v.norm(f.name) in v.GIL_ACQUIRE or f.name in v.GIL_ACQUIRE)


def _gil_any(f: Frame) -> bool:
    return f.kind != "python" and v.matches(f.name, v.GIL_ACQUIRE, v.GIL_ACQUIRE_SUBSTR)


def wait_key(view: ThreadView, cited: list[int]) -> int | None:
    """The blocking call: a Python-level wait (Condition.wait, Thread.join, Connection._recv) says
    what a Python lock wait is; otherwise the public libc/interpreter call (pthread_cond_wait,
    pthread_mutex_lock, recv, Lock.acquire); otherwise the frame that decided the wait kind."""
    frames = view.frames
    if any(_gil_any(frames[i]) for i in cited[:1]):
        return gil_key(view, cited)
    native = next((p for p, i in enumerate(cited) if _public_wait(frames[i])), None)
    python = next((p for p, i in enumerate(cited) if _py_wait(frames[i])), None)
    lock_wait = native is not None and v.norm(frames[cited[native]].name) in v.PY_LOCK_WAIT | {"rlock_acquire"}
    if python is not None and (native is None or lock_wait):
        return _outermost_run(frames, cited, python, _py_wait)
    if native is not None:
        return _outermost_run(frames, cited, native, _public_wait)
    if cited and frames[cited[0]].kind != "python" and v.norm(frames[cited[0]].name) in \
            v.WAIT_PRIMITIVES - v.EVAL_FRAMES:
        return cited[0]
    return None


def gil_key(view: ThreadView, cited: list[int]) -> int | None:
    """The call that waits for the GIL: the outermost interpreter entry point (PyGILState_Ensure,
    PyEval_RestoreThread, take_gil), else a binding library's guard (gil_scoped_acquire)."""
    frames = view.frames
    first = next((p for p, i in enumerate(cited) if _gil_any(frames[i])), None)
    if first is None:
        return None
    run = [p for p in range(first, len(cited)) if _gil_any(frames[cited[p]])]
    run = [p for k, p in enumerate(run) if p == first + k]          # consecutive only
    exact = [p for p in run if _gil_exact(frames[cited[p]])]
    return cited[(exact or run)[-1]]


def project_key(view: ThreadView, after: int = -1) -> int | None:
    """The first project frame from the deciding wait outwards (or after index ``after``)."""
    for i in range(max(_start(view), after + 1), len(view.frames)):
        if is_named_project_frame(view.frames[i]):
            return i
    return None


def caller_key(view: ThreadView, project: int | None) -> int | None:
    """The Python call that entered the native project frame ``project``."""
    if project is None or view.frames[project].kind == "python":
        return None
    return next((i for i in range(project + 1, len(view.frames))
                 if view.frames[i].kind == "python" and is_named_project_frame(view.frames[i])), None)


def _entry_after_gil(view: ThreadView, cited: list[int], gil: int | None) -> int | None:
    """Without a project frame: the frame that asked for the GIL (a ctypes callback trampoline)."""
    if gil is None:
        return None
    return next((i for i in cited if i > gil and not _gil_any(view.frames[i])
                 and v.norm(view.frames[i].name) not in v.EVAL_FRAMES), None)


def key_indices(view: ThreadView, keys: Sequence[Key], cited: list[int]) -> list[int]:
    """Indices into ``view.frames`` of the frames the rule rests on, innermost first."""
    out: list[int | None] = []
    gil = gil_key(view, cited) if Key.GIL in keys else None
    if Key.WAIT in keys:
        out.append(wait_key(view, cited))
    if Key.GIL in keys:
        out.append(gil)
    project = project_key(view) if Key.PROJECT in keys or Key.CALLER in keys else None
    if Key.PROJECT in keys:
        out.append(project if project is not None else _entry_after_gil(view, cited, gil))
    if Key.CALLER in keys:
        out.append(caller_key(view, project))
    return sorted({i for i in out if i is not None})


def cite_item(t: ThreadView, role: str, engine: str | None, keys: Sequence[Key]) -> EvidenceItem:
    """An evidence item: the thread's cited frames, with the key frames among them (a key frame the
    citation stops short of, such as a project frame under stdlib Python frames, is added in order)."""
    rows = _cited(t)
    marked: set[int] = set()      # frame indices of the rows that are key frames
    for k in key_indices(t, keys, [i for i, _ in rows]):
        before = [r for r in rows if r[0] <= k]
        if before and before[-1][0] == k:
            marked.add(k)
        elif before and before[-1][1] == v.describe(t.frames[k]):
            marked.add(before[-1][0])        # merged into the same line as a repeat of the frame above
        else:
            rows.insert(len(before), (k, v.describe(t.frames[k])))
            marked.add(k)
    return item_of(t.pid, t.tid, role, engine, rows, marked)


def item_of(pid: int, tid: int, role: str, engine: str | None, rows: Sequence[tuple[int, str]],
            keys: set[int], tool: str | None = None) -> EvidenceItem:
    """An evidence item from its rows (frame index in the thread's stack, the line shown) and the frame
    indices among them the rule rests on: each line keeps a reference to its captured frame (in
    ``frames_by_tool[tool]`` when the rule read another tool's stack)."""
    return EvidenceItem(pid=pid, tid=tid, role=role, engine=engine, frames=[text for _, text in rows],
                        key_frames=[n for n, (i, _) in enumerate(rows) if i in keys],
                        refs=[FrameRef(pid=pid, tid=tid, index=i, tool=tool) for i, _ in rows])


def where(view: ThreadView, n: int = 2) -> str:
    """`` in map_pages ← prealloc_worker``: the project frames nearest the wait (native ones of the
    innermost segment, then the application's Python frames; never libc, STL or the stdlib)."""
    segment = v.innermost_segment(view.frames)
    names = [v.short_name(f.name, components=2).removesuffix("()") for f in segment
             if is_named_project_frame(f)]
    python = [f for f in view.frames[len(segment):] if f.kind == "python" and is_named_project_frame(f)]
    names += [f.name for f in python if not f.name.startswith("<")]
    if not names:   # module-level code: its file and line say where
        names = [v.describe(f) for f in python[:1]]
    unique = list(dict.fromkeys(x for x in names if x.strip()))[:n]   # no dangling arrow for a nameless frame
    return f" in {' ← '.join(unique)}" if unique else ""
