"""Classify every thread of a captured process: what it is doing and what it waits for.

Pure: reads ThreadEvidence/ProcessEvidence only. Sources, in order of trust:
the interpreter's own flags (pystack "Has the GIL" / the GIL struct read from
/proc), the innermost native frames (what the thread is blocked in), then
the kernel's view (wchan, syscall number, futex address) when no stack tool
could read the thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import Enum

from kvdiag.analyze import vocab as v
from kvdiag.model.evidence import FdInfo, Frame, ProcessEvidence, ThreadEvidence
from kvdiag.model.kinds import GilState, ThreadState
from kvdiag.osread.syscall import syscalls_of

# A thread that used at least this many CPU ticks over the sampling interval is running; a GIL
# waiter's 5 ms timed waits never add up to that.
RUNNING_TICKS = 2


class WaitKind(str, Enum):
    RUNNING = "running"
    GIL_WAIT = "gil_wait"
    COND_WAIT = "cond_wait"            # native condition variable
    MUTEX_WAIT = "mutex_wait"
    PY_LOCK_WAIT = "py_lock_wait"      # Python-level Lock/Condition/Event/Queue/join (semaphore)
    FUTEX_WAIT = "futex_wait"          # a futex wait we cannot attribute further
    IO_READ = "io_read"
    IO_WRITE = "io_write"              # a write/send blocked on a full pipe or socket: waits for its reader
    EVENT_WAIT = "event_wait"          # poll/epoll/select/accept/signal wait: waits for the outside world
    SLEEP = "sleep"
    STOPPED = "stopped"
    ZOMBIE = "zombie"
    UNKNOWN = "unknown"


BLOCKED_KINDS = frozenset({WaitKind.COND_WAIT, WaitKind.MUTEX_WAIT, WaitKind.PY_LOCK_WAIT, WaitKind.FUTEX_WAIT,
                           WaitKind.IO_READ, WaitKind.IO_WRITE, WaitKind.GIL_WAIT})


@dataclass
class ThreadView:
    """One thread as the rules see it."""

    pid: int
    tid: int
    name: str
    is_main: bool
    kind: WaitKind
    running: bool = False
    stopped: bool = False
    holds_gil: bool = False
    gil_holder_sources: list[str] = field(default_factory=list)   # "pystack", "proc", "py-spy", "inferred"
    waits_gil: bool = False
    gil_wait_signals: list[str] = field(default_factory=list)      # why we think it waits for the GIL
    wait_addr: int | None = None
    owner_tid: int | None = None
    socket_read: bool = False          # the read is on a socket (wchan), not a pipe or tty
    tty_read: bool = False
    py_wait: str | None = None         # "py_cond", "join", "read", "event" from Python frames
    idle_by_design: bool = False
    timed: bool = False                # the wait has a timeout: it ends by itself, so it cannot deadlock
    wait_frame: str | None = None      # the frame that decided the kind
    frames: list[Frame] = field(default_factory=list)
    libraries: frozenset[str] = frozenset()
    has_frames: bool = False
    woke: bool = False                 # context switches during the sample window: not parked for good
    quiet: bool | None = None          # no CPU and no context switch during the window (None: not sampled)
    wait_forever: bool = False         # poll/epoll/select with no timeout
    blocked_fds: list[FdInfo] = field(default_factory=list)
    asyncio_loop: bool = False         # the thread runs an asyncio event loop (its frames say so)
    shared_futex: bool = False         # a futex wait without FUTEX_PRIVATE_FLAG: another process may wake it
    # What a read or event wait is for, from the Python frames alone: "request" (a server or worker waiting
    # for its next request or task), "reply" (a client call waiting for its answer, a parent for its
    # workers' results), None (the frames do not say). /proc's fd peers, when read, say it better.
    read_role: str | None = None
    samples_in_wait: int = 0           # stack tools whose own reading shows this thread in the same wait
    proc_saw_read: bool = False        # /proc itself (wchan or syscall) found the thread in a read
    proc_saw_other: bool = False       # /proc found it in something else (a sleep, another syscall, running)
    samples_moved: bool = False        # another stack tool found it in a different wait: it moved meanwhile
    # Python frames that carry lock-typed locals (pystack-locals), innermost first.
    lock_frames: list[Frame] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"thread {self.tid} ({self.name})" if self.name else f"thread {self.tid}"


def _kind_from_frames(segment: list[Frame]) -> tuple[WaitKind | None, str | None]:
    """Innermost frame that says what the thread waits in (a condvar wait inside take_gil is a GIL wait)."""
    gil = _gil_frames(segment)
    if gil is not None:
        return WaitKind.GIL_WAIT, gil
    for f in segment:
        name = f.name
        if v.matches(name, v.GIL_ACQUIRE, v.GIL_ACQUIRE_SUBSTR):
            return WaitKind.GIL_WAIT, name
        if v.matches(name, v.MUTEX_WAIT, v.MUTEX_WAIT_SUBSTR):
            return WaitKind.MUTEX_WAIT, name
        if v.matches(name, v.PY_LOCK_WAIT):
            return WaitKind.PY_LOCK_WAIT, name
        if v.matches(name, v.COND_WAIT, v.COND_WAIT_SUBSTR):
            return WaitKind.COND_WAIT, name
        if v.matches(name, v.IO_READ):
            return WaitKind.IO_READ, name
        if v.matches(name, v.EVENT_WAIT):
            return WaitKind.EVENT_WAIT, name
        if v.matches(name, v.SLEEP):
            return WaitKind.SLEEP, name
        if v.matches(name, v.SPIN):
            return WaitKind.RUNNING, name
        if v.matches(name, v.JOIN_WAIT):
            return WaitKind.FUTEX_WAIT, name
    return None, None


def _gil_frames(segment: list[Frame]) -> str | None:
    for f in segment:
        if v.matches(f.name, v.GIL_ACQUIRE, v.GIL_ACQUIRE_SUBSTR):
            return f.name
    return None


def _python_wait(stacks: list[list[Frame]]) -> str | None:
    """Meaning of the innermost Python frames (first three per stack) when they name a wait."""
    for frames in stacks:
        seen = 0
        for f in frames:
            if f.kind != "python":
                continue
            kind = v.python_kind(f)
            if kind:
                return kind
            seen += 1
            if seen >= 3:
                break
    return None


def _idle_by_design(th: ThreadEvidence, frames_all: list[Frame]) -> bool:
    if th.name and v.IDLE_THREAD_NAMES.search(th.name):
        return True
    for f in frames_all:
        if f.name in v.IDLE_FRAME_NAMES or v.norm(f.name) in v.IDLE_FRAME_NAMES:
            return True
        text = f"{f.name} {f.file or ''}"
        if any(s in text for s in v.IDLE_FRAME_SUBSTR):
            return True
        if f.kind == "python" and f.file and (tuple(f.file.rsplit("/", 2)[-2:]), f.name.rsplit(".", 1)[-1]) in \
                v.IDLE_PY_FRAMES:
            return True
    return False


def _libraries(frames: list[Frame]) -> frozenset[str]:
    """Application components on the stack (not libc, the interpreter, libffi, libstdc++)."""
    return frozenset(k for f in frames if not v.is_system_frame(f) and (k := v.library_key(f)))


_PY_WAIT_KIND = {"read": WaitKind.IO_READ, "event": WaitKind.EVENT_WAIT}


def _sample_kind(frames: list[Frame]) -> WaitKind | None:
    """The wait one tool's own stack shows (its native frames, else its Python frames)."""
    kind = _kind_from_frames(v.innermost_segment(frames))[0]
    return kind if kind is not None else _PY_WAIT_KIND.get(_python_wait([frames]) or "")


def _read_role(stacks: list[list[Frame]]) -> str | None:
    """"request" / "reply" / None for a blocked read, from the innermost Python frames that say it."""
    for frames in stacks:
        py = [f for f in frames if f.kind == "python"]
        for f in py:
            if v.py_frame_in(f, v.REQUEST_WAIT_PY_FRAMES):
                return "request"
            if v.py_frame_in(f, v.REPLY_WAIT_PY_FRAMES) or f.name.rsplit(".", 1)[-1] in v.REPLY_WAIT_FUNCS:
                return "reply"
        # A multiprocessing Connection or Queue: a process multiprocessing started reads what its parent
        # sends (its next task); the process that started the workers reads their results.
        if any(tuple((f.file or "").rsplit("/", 2)[-2:]) in v.MP_CHANNEL_FILES for f in py[:4]):
            return "request" if any(v.py_frame_in(f, v.MP_CHILD_PY_FRAMES) for f in py) else "reply"
    return None


def classify_thread(th: ThreadEvidence, proc: ProcessEvidence, machine: str | None = None) -> ThreadView:
    """What ``th`` is doing, from all the evidence captured for it."""
    frames = list(th.frames)
    all_stacks = [frames] + [fs for fs in th.frames_by_tool.values() if fs is not frames]
    segments = [v.innermost_segment(fs) for fs in all_stacks if fs]
    frames_all = [f for fs in all_stacks for f in fs]
    view = ThreadView(pid=proc.pid, tid=th.tid, name=th.name or "", is_main=th.tid == proc.pid,
                      kind=WaitKind.UNKNOWN, frames=frames, has_frames=bool(frames_all),
                      libraries=_libraries(frames_all))
    view.stopped = th.state is ThreadState.STOPPED
    # A thread blocked writing a full pipe or socket waits on its reader, whatever its name says (a queue's
    # feeder thread is idle by design only while it has nothing to write).
    view.idle_by_design = not th.write_fds and (_idle_by_design(th, frames_all) or any(
        m in " ".join(proc.cmdline) for m in v.IDLE_PROCESS_MARKERS))

    # GIL: interpreter flags first.
    holders = [tool for tool, st in th.gil_by_tool.items() if st is GilState.HOLDS]
    if not holders and th.gil is GilState.HOLDS:
        holders = ["merged"]
    view.holds_gil = bool(holders)
    view.gil_holder_sources = holders
    signals: list[str] = []
    if th.gil_by_tool.get("pystack") is GilState.WAITING:
        signals.append("pystack: Waiting for the GIL")
    gil_frame = next((g for g in (_gil_frames(s) for s in segments) if g), None)
    if gil_frame:
        signals.append(f"frame {gil_frame}")
    if th.in_gil_struct:
        signals.append("futex in the GIL struct (_PyRuntime)")
    if not holders and th.gil is GilState.WAITING and not signals:
        signals.append("GIL waiting flag")
    view.waits_gil = bool(signals) and not view.holds_gil
    view.gil_wait_signals = signals if view.waits_gil else []

    # What it is blocked in: frames (every tool's innermost segment), then the kernel.
    kind: WaitKind | None = None
    wait_frame: str | None = None
    # The tools read the thread at different instants. When the best stack has native frames and
    # shows no wait, the thread was executing then; another tool's older wait does not count.
    executing = any(f.kind == "native" for f in frames) and _kind_from_frames(segments[0] if segments else [])[0] \
        is None
    for seg in segments[:1] if executing else segments:
        kind, wait_frame = _kind_from_frames(seg)
        if kind is not None:
            break
    view.py_wait = _python_wait(all_stacks)
    sysnames = syscalls_of(machine)
    wchan = th.wchan or ""
    nr = th.syscall_nr
    view.wait_addr = th.futex_addr
    view.owner_tid = th.futex_owner_tid
    view.socket_read = any(wchan.startswith(w) for w in v.WCHAN_SOCKET_READ)
    view.tty_read = any(wchan.startswith(w) for w in v.WCHAN_TTY)
    # A send or write parks in the same kernel waits as a read (wait_woken): the syscall says which it is.
    writing = nr is not None and nr in sysnames["write"]
    receiving = nr is not None and nr in sysnames["mq_receive"]   # a POSIX message queue: a read
    view.proc_saw_read = receiving or not writing and (any(wchan.startswith(w) for w in v.WCHAN_READ) or (
        nr is not None and nr in sysnames["read"]))
    view.proc_saw_other = not view.proc_saw_read and (bool(wchan) or nr is not None)
    if kind is None:
        if view.py_wait == "join" or view.py_wait == "py_cond":
            kind = WaitKind.PY_LOCK_WAIT
        elif view.py_wait == "read":
            kind = WaitKind.IO_READ
        elif view.py_wait == "event":
            kind = WaitKind.EVENT_WAIT
    if kind is None:
        if writing and (th.write_fds or any(wchan.startswith(w) for w in (*v.WCHAN_READ, "pipe_write",
                                                                           "sk_stream_wait_memory"))):
            kind = WaitKind.IO_WRITE
        elif receiving or any(wchan.startswith(w) for w in v.WCHAN_READ) or (
                nr is not None and nr in sysnames["read"]):
            kind = WaitKind.IO_READ
        elif any(wchan.startswith(w) for w in v.WCHAN_EVENT) or (nr is not None and nr in sysnames["event"]):
            kind = WaitKind.EVENT_WAIT
        elif any(wchan.startswith(w) for w in v.WCHAN_SLEEP) or (nr is not None and nr in sysnames["sleep"]) or (
                nr is not None and nr in sysnames["restart"]):
            # restart_syscall: a timed wait (a sleep, a timed futex or poll) resumed after a stop; it ends by
            # itself like a sleep, and the kernel no longer says which it was.
            kind = WaitKind.SLEEP
        elif th.futex_addr is not None or any(wchan.startswith(w) for w in v.WCHAN_FUTEX) or (
                nr is not None and nr in sysnames["futex"]):
            op = _futex_cmd(th.syscall)
            kind = WaitKind.MUTEX_WAIT if op == 0 or th.futex_owner_tid else WaitKind.FUTEX_WAIT
        if kind is not None:
            wait_frame = f"wchan {wchan}" if wchan else f"syscall {nr}"
            if nr is not None and nr in sysnames["restart"]:
                wait_frame = "restart_syscall (a timed wait resumed after a stop)"
    if view.waits_gil:
        kind = WaitKind.GIL_WAIT
        wait_frame = gil_frame or wait_frame
    running = (th.cpu_ticks_delta is not None and th.cpu_ticks_delta >= RUNNING_TICKS) or (
        th.cpu_ticks_delta is None and th.state is ThreadState.RUNNING) or kind is WaitKind.RUNNING
    if th.cpu_ticks_delta is None and th.state is ThreadState.UNKNOWN and executing and view.holds_gil and \
            kind is None:
        running = True   # no /proc: holding the GIL outside any wait is executing Python
    view.running = running and not view.stopped
    if view.running:
        kind = WaitKind.RUNNING
    elif th.state is ThreadState.ZOMBIE:
        kind = WaitKind.ZOMBIE
    elif kind is None:
        kind = WaitKind.STOPPED if view.stopped else WaitKind.UNKNOWN
    view.kind = kind
    view.wait_frame = wait_frame
    view.timed = _is_timed(th, segments, kind)
    if th.wait_timeout_ms is not None:
        view.wait_forever = th.wait_timeout_ms < 0
        view.timed = view.timed or th.wait_timeout_ms >= 0
    view.blocked_fds = list(th.blocked_fds)
    op = _futex_op(th.syscall) if nr is not None and nr in sysnames["futex"] else None
    # multiprocessing's Lock/Semaphore/Event/Condition live in shared memory: another process posts them.
    view.shared_futex = (op is not None and not op & _FUTEX_PRIVATE_FLAG) or any(
        f.kind == "python" and (f.file or "").endswith("multiprocessing/synchronize.py") for f in frames_all[:40])
    if kind in (WaitKind.IO_READ, WaitKind.EVENT_WAIT):
        view.read_role = _read_role(all_stacks)
        kinds = [_sample_kind(fs) for fs in th.frames_by_tool.values()]
        view.samples_in_wait = sum(1 for k in kinds if k is kind)
        view.samples_moved = any(k is not None and k is not kind for k in kinds)
    view.lock_frames = [f for fs in th.frames_by_tool.values() for f in fs if f.kind == "python" and f.locks]
    view.asyncio_loop = any(f.kind == "python" and ("asyncio" in (f.file or "") or f.name.endswith("_run_once"))
                            for f in frames_all)
    if th.ctx_switches_delta is not None and th.cpu_ticks_delta is not None:
        view.quiet = th.ctx_switches_delta == 0 and th.cpu_ticks_delta == 0
        # A GIL waiter wakes every switch interval by design; for anyone else a wakeup means
        # something signalled, timed out or delivered data during the window.
        view.woke = th.ctx_switches_delta > 0 and kind is not WaitKind.GIL_WAIT
    return view


_TIMED_MARKERS = ("timedwait", "clockwait", "timedlock", "clocklock", "wait_until", "wait_for", "sem_timedwait")


def _is_timed(th: ThreadEvidence, segments: list[list[Frame]], kind: WaitKind | None) -> bool:
    """A futex wait's timeout argument is the ground truth; otherwise the wait function's name."""
    if th.syscall and th.futex_addr is not None:
        parts = th.syscall.split()
        if len(parts) > 4:
            try:
                return int(parts[4], 16) != 0
            except ValueError:
                pass
    if kind in (WaitKind.GIL_WAIT, WaitKind.EVENT_WAIT, WaitKind.SLEEP):
        return False
    return any(m in f.name for seg in segments for f in seg[:8] for m in _TIMED_MARKERS)


_FUTEX_PRIVATE_FLAG = 128


def _futex_op(raw: str | None) -> int | None:
    parts = (raw or "").split()
    try:
        return int(parts[2], 16) if len(parts) > 2 else None
    except ValueError:
        return None


def _futex_cmd(raw: str | None) -> int | None:
    if not raw:
        return None
    parts = raw.split()
    if len(parts) < 3:
        return None
    try:
        return int(parts[2], 16) & 0x7F
    except ValueError:
        return None


# The rules of one analysis ask for the same process's views many times (each process rule, the engine and
# peer judges, the cross-process and per-node judges). Inside :func:`views_memo` (one diagnosis, over evidence
# nobody changes meanwhile) they are built once per process object: keyed by identity, the process kept beside
# its views so an id is never reused while cached. Views are read-only once built.
_MEMO: ContextVar[dict[tuple[int, str | None], tuple[ProcessEvidence, list[ThreadView]]] | None] = ContextVar(
    "kvdiag_thread_views", default=None)


@contextmanager
def views_memo() -> Iterator[None]:
    """Build each process's thread views once for the duration of the block."""
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def classify_process(proc: ProcessEvidence, machine: str | None = None) -> list[ThreadView]:
    memo = _MEMO.get()
    if memo is None:
        return [classify_thread(t, proc, machine) for t in proc.threads]
    key = (id(proc), machine)
    hit = memo.get(key)
    if hit is not None and hit[0] is proc:
        return list(hit[1])
    views = [classify_thread(t, proc, machine) for t in proc.threads]
    memo[key] = (proc, views)
    return list(views)
