"""Health is earned: what each blocked thread waits for, and the rule that a stuck outcome is a hang.

Every thread that is not running waits either for *new work* (a server's accept or poll on its sockets, a
pool worker on its task queue, a timer loop that keeps firing) or for the *outcome* of work already started
(a join, a result, a lock, a barrier, a reply to a request it sent, a child it waits for, a file lock, the
other end of a FIFO). Waiting for new work is what an idle service does; waiting for an outcome is healthy
only while something that could produce it moves.

The rule (:func:`stuck_outcome`): when the progress window observed every captured process and nothing
advanced in any of them (no CPU, no I/O, no log growth, no shared-memory byte changed; a wakeup alone is a
timer firing, not progress), an outcome-wait that did not advance is a hang. Its root is followed as far as
the evidence reaches: the holder of the lock, the peer at the other end, the child, nobody.

Pure: reads the bundle only. A bundle captured before threads were observed one by one says nothing here
(missing observation is "not observed", never "no progress").
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from kvdiag.analyze import vocab as v
from kvdiag.analyze.classify import RUNNING_TICKS, ThreadView, WaitKind, classify_process
from kvdiag.analyze.evidence import BLOCKED_KEYS, CONTEXT_KEYS, Key, item_of, where
from kvdiag.analyze.rulekit import cited, wake_signals
from kvdiag.defaults import LONG_SLEEP_S
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import FdInfo, ProcessEvidence, ThreadEvidence
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.run import Finding
from kvdiag.model.verdict import EvidenceItem, ThreadWait, Verdict, WaitPurpose
from kvdiag.osread.syscall import syscalls_of

# Python frames (file tail, function) that wait for the next task or job: a worker's idle loop.
# What only a join or a result is: a main thread with a signal handler waiting on anything else (an Event its
# SIGTERM handler sets) is a daemon waiting to be told.
_RESULT_WORDS = ("join", "result", "waitpid", "AsyncResult", "pool map", "feeder", "Barrier")
# Python frames whose wait is for the outcome of work already started, and how a user names it.
_OUTCOME_FRAMES = (
    ("ApplyResult.get", "AsyncResult.get (a pool task's result)"), ("ApplyResult.wait", "AsyncResult.wait"),
    ("MapResult", "a pool map's result"), ("Future.result", "Future.result (work already submitted)"),
    ("Thread.join", "Thread.join"), ("_wait_for_tstate_lock", "Thread.join"), ("Process.join", "Process.join"),
    ("Popen.wait", "waitpid of a child"), ("Barrier.wait", "Barrier.wait"), ("Event.wait", "Event.wait"),
    ("Condition.wait", "Condition.wait"), ("Semaphore.acquire", "Semaphore.acquire"),
    ("_finalize_join", "joining its queue's feeder thread"), ("SemLock.__enter__", "a multiprocessing lock"),
)
_BLOCKING = (WaitKind.PY_LOCK_WAIT, WaitKind.COND_WAIT, WaitKind.MUTEX_WAIT, WaitKind.FUTEX_WAIT)
# A spinner naps and wakes by design; at least this many voluntary switches in the window says it loops.
_SPIN_SWITCHES = 3


# Native frames of a runtime's own thread team (OpenMP, BLAS pools): a fork copies only the calling thread.
_POOL_FRAMES = ("GOMP_", "gomp_", "__kmp", "blas_thread", "omp_", "exec_blas")


def _native_words(w: Wait) -> str:
    names = [f.name for f in w.th.frames[:24] if f.kind == "native" and any(s in f.name for s in _POOL_FRAMES)]
    return f" ({' ← '.join(dict.fromkeys(names[:3]))})" if names else ""


def _py_names(t: ThreadView, n: int = 3) -> list[str]:
    return [f.name for f in t.frames if f.kind == "python"][:n]


# The same waits by file and bare function name (pystack names a frame by its function alone).
_OUTCOME_BY_FILE = {
    ("pool.py", "get"): "AsyncResult.get (a pool task's result)", ("pool.py", "wait"): "AsyncResult.wait",
    ("_base.py", "result"): "Future.result (work already submitted)", ("threading.py", "join"): "Thread.join",
    ("threading.py", "_wait_for_tstate_lock"): "Thread.join", ("process.py", "join"): "Process.join",
    ("popen_fork.py", "wait"): "waitpid of a child", ("threading.py", "wait"): "Event/Condition.wait",
    ("synchronize.py", "wait"): "a multiprocessing Event/Condition/Barrier",
    ("queues.py", "_finalize_join"): "joining its queue's feeder thread",
}


def _outcome_words(t: ThreadView) -> str | None:
    """The outermost recognised wait among the innermost Python frames: ``ApplyResult.wait`` says more than
    the ``Condition.wait`` it is built on."""
    found: str | None = None
    for f in [f for f in t.frames if f.kind == "python"][:6]:
        words = next((w for needle, w in _OUTCOME_FRAMES if needle in f.name), None)
        if words is None:
            base = (f.file or "").rsplit("/", 1)[-1]
            words = _OUTCOME_BY_FILE.get((base, f.name.rsplit(".", 1)[-1]))
        if words is not None:
            found = words
    return found


def _task_queue(t: ThreadView) -> bool:
    return any(v.py_frame_in(f, v.TASK_QUEUE_FRAMES) for f in t.frames[:24])


def _frames_text(t: ThreadView) -> str:
    """The application's frames nearest the wait (as every rule's summary names them), else the innermost
    Python frames, else what decided the wait."""
    mine = where(t).removeprefix(" in ")
    if mine:
        return mine
    names = list(dict.fromkeys(_py_names(t, 3))) or [t.wait_frame or t.kind.value]
    return " ← ".join(names)


@dataclass
class Wait:
    """One thread's wait as this rule sees it."""

    proc: ProcessEvidence
    th: ThreadEvidence
    view: ThreadView
    purpose: WaitPurpose
    what: str
    # Another thread of its process could still complete an in-process wait: it sleeps or waits with a
    # timeout (a one-shot sleep ends and may finish the work), runs, or waits for something we cannot name.
    may_be_completed: bool = False

    @property
    def advanced(self) -> bool | None:
        o = self.th.observed
        if o is None:
            return None
        if self.view.kind is WaitKind.SLEEP or (self.view.timed and self.view.kind is not WaitKind.GIL_WAIT):
            # A timer that fires runs a loop's check for a tick and sleeps again in the same call: progress only
            # if it ran longer than that, did I/O, or is somewhere else now.
            return (o.cpu_ticks or 0) >= RUNNING_TICKS or any(n > 0 for n in o.io_delta.values()) or \
                o.same_syscall is False
        return o.advanced

    @property
    def woke(self) -> bool:
        """It was woken in a wait with no timeout: what it waits on delivered something (a timer's wakeups,
        a GIL waiter's switch intervals, say nothing)."""
        o = self.th.observed
        return o is not None and bool(o.voluntary_switches) and not self.view.timed and \
            self.view.kind not in (WaitKind.SLEEP, WaitKind.GIL_WAIT) and self.purpose is not WaitPurpose.RUNNING

    @property
    def stuck(self) -> bool:
        return self.purpose is WaitPurpose.OUTCOME and self.advanced is False and not self.view.timed and \
            not self.may_be_completed and not self.woke

    @property
    def in_process(self) -> bool:
        """Its outcome comes from another thread of its own process (no kernel-named party, no peer)."""
        return self.th.kernel_wait is None and self.th.waited_pid is None and _peers(self) is None


def _self_pair(f: FdInfo, pid: int) -> bool:
    """One end of a socketpair or pipe whose other end only its own process holds: a loop's wakeup pipe."""
    peers = (f.writer_pids if f.kind == "pipe" and f.writer_pids is not None else f.peer_pids)
    return f.kind in ("socket", "pipe") and not f.listening and bool(peers) and set(peers) == {pid}


def _loop_on_itself(proc: ProcessEvidence, t: ThreadView) -> bool:
    """An asyncio loop run to complete a coroutine (run_until_complete, asyncio.run), parked with no timeout,
    whose selector holds nothing but its own wakeup pipe: no listening or connected socket, no timer, no child
    watcher; and no signal handler that could deliver to it. Only another thread's call_soon_threadsafe can
    wake it."""
    if not t.asyncio_loop or not t.wait_forever or not t.blocked_fds or wake_signals(proc):
        return False
    if not any(f.kind == "python" and f.name.endswith("run_until_complete") for f in t.frames):
        return False
    return all(_self_pair(f, proc.pid) for f in t.blocked_fds)


def classify_wait(proc: ProcessEvidence, th: ThreadEvidence, t: ThreadView, machine: str | None = None) -> Wait:
    """New work, an outcome, running, or other (a GIL wait, a state no tool could read)."""
    def w(purpose: WaitPurpose, what: str) -> Wait:
        return Wait(proc=proc, th=th, view=t, purpose=purpose, what=what)

    if t.running:
        return w(WaitPurpose.RUNNING, "running")
    kw = th.kernel_wait
    if kw is not None:
        if kw.what == "fifo_open":
            other = "reader" if kw.access == "write" else "writer"
            return w(WaitPurpose.OUTCOME, f"open() of the FIFO {kw.path} (waits for a {other}; {_frames_text(t)})")
        call = "flock()" if kw.what == "flock" else "a record lock (fcntl)"
        return w(WaitPurpose.OUTCOME, f"{call} on {kw.path or kw.file} ({_frames_text(t)})")
    if th.write_fds:
        f = th.write_fds[0]
        feeder = any(x.kind == "python" and x.name.endswith("_feed") for x in t.frames) or \
            "Feeder" in (th.name or "")
        whose = "the queue's feeder thread flushing what was put on a multiprocessing.Queue: " if feeder else ""
        return w(WaitPurpose.OUTCOME, f"a write into a full {f.kind} ({whose}{_frames_text(t)}); it waits for its "
                                      "reader to drain it")
    if th.waited_pid is not None:
        whom = f"child pid {th.waited_pid}" if th.waited_pid > 0 else "any child"
        return w(WaitPurpose.OUTCOME, f"waitpid for {whom} ({_frames_text(t)})")
    calls = syscalls_of(machine)
    if th.syscall_nr is not None and th.syscall_nr in calls["connect"] and (th.wchan or "").startswith(
            "unix_wait_for_peer"):
        # A Unix-socket connect() parks until the listener accepts (its backlog is full): no timeout ends it.
        return w(WaitPurpose.OUTCOME, f"connect() to a Unix socket whose listener has not accepted it (its backlog "
                                      f"is full) ({_frames_text(t)})")
    if th.wait_signals and not t.running:
        names = ", ".join(_signame(n) for n in th.wait_signals[:4])
        kids = proc.children
        if set(th.wait_signals) == {_SIGCHLD} and kids is not None and set(kids) <= set(proc.exited_children or ()):
            gone = f"its {len(kids)} child(ren) already exited" if kids else "it has no child"
            return w(WaitPurpose.OUTCOME, f"sigwait for SIGCHLD while no child of it is alive ({gone}; a child's "
                                          f"exit is the only sender) ({_frames_text(t)})")
        return w(WaitPurpose.NEW_WORK, f"a wait for a signal ({names}) ({_frames_text(t)})")
    if t.kind is WaitKind.GIL_WAIT:
        return w(WaitPurpose.OTHER, "waits for the GIL")
    if t.kind is WaitKind.SLEEP:
        return w(WaitPurpose.NEW_WORK, f"a timed sleep ({_frames_text(t)}): a timer loop")
    if t.kind is WaitKind.EVENT_WAIT and _loop_on_itself(proc, t):
        return w(WaitPurpose.OUTCOME, f"an asyncio loop inside run_until_complete with nothing to wait on but its "
                                      f"own wakeup pipe (no socket, no timer): its main coroutine awaits a future "
                                      f"only another thread could set ({_frames_text(t)})")
    if t.kind is WaitKind.EVENT_WAIT:
        # A poll over several sources is a loop waiting for whatever comes (an executor's manager thread polls
        # its workers' results and its wakeup pipe alike), whatever its frames call it.
        return w(WaitPurpose.NEW_WORK, f"accept/poll on its sockets ({_frames_text(t)})")
    if t.kind is WaitKind.IO_READ:
        if t.read_role == "reply" and not t.idle_by_design:
            return w(WaitPurpose.OUTCOME, f"a read of a reply ({_frames_text(t)})")
        if t.read_role == "request" or t.idle_by_design:
            return w(WaitPurpose.NEW_WORK, f"a read of its next request or task ({_frames_text(t)})")
        socks = [f for f in th.blocked_fds if f.kind == "socket" and not f.listening]
        # A connection it opened (a TCP client end, a Unix socket connected to a named listener) carries the
        # replies to what it sent; a socketpair's ends are symmetric and say nothing.
        if socks and all(not f.accepted and f.peer_pids and (f.proto in ("tcp", "tcp6") or (
                f.proto == "unix" and bool(f.address))) for f in socks):
            return w(WaitPurpose.OUTCOME, f"a read of a reply on a connection it opened ({_frames_text(t)})")
        if socks and any(f.accepted for f in socks):
            return w(WaitPurpose.NEW_WORK, f"a read of the next request on an accepted connection ({_frames_text(t)})")
        return w(WaitPurpose.OTHER, f"a read ({_frames_text(t)}): for a request or a reply, the frames do not say")
    if t.kind in _BLOCKING:
        if t.timed:
            return w(WaitPurpose.NEW_WORK, f"a timed wait ({_frames_text(t)}): a loop that keeps firing")
        if t.idle_by_design or _task_queue(t):
            return w(WaitPurpose.NEW_WORK, f"a task queue ({_frames_text(t)})")
        words = _outcome_words(t)
        if t.is_main and t.py_wait == "py_cond" and wake_signals(proc) and not any(
                r in (words or "") for r in _RESULT_WORDS):
            return w(WaitPurpose.NEW_WORK, f"a signal handler's Event ({_frames_text(t)})")
        if words is None and any(s in f.name for f in th.frames[:24] for s in _POOL_FRAMES):
            words = "a thread team's barrier"
        if words is None and not any(f.kind == "python" for f in t.frames):
            lib = _parked_native_worker(th, t)
            if lib is not None:
                return w(WaitPurpose.NEW_WORK, f"a native library's own worker thread ({lib}), parked in its "
                                               "start routine's loop between jobs")
            # A native thread on a condvar or futex deeper in its work: a pool's idle worker and a waiter for a
            # result look alike.
            return w(WaitPurpose.OTHER, f"a native {t.kind.value.replace('_', ' ')} ({t.wait_frame or '?'}): "
                                        "for work or for a result, its frames do not say")
        if words is None and t.kind is WaitKind.MUTEX_WAIT:
            words = "a mutex"
        if words is None:
            words = "a lock or condition"
        return w(WaitPurpose.OUTCOME, f"{words} ({_frames_text(t)})")
    return w(WaitPurpose.OTHER, t.kind.value)


# Native frames that are the C library's own (the wait, the thread start), not the code the thread runs.
_LIBC = ("libc.so", "libc-", "libpthread", "ld-linux")
# Frames of the interpreter (by the file's name, or the function's): a thread that ran Python (or waits to) is
# not a native library's own worker.
_INTERPRETER_FILES = ("libpython", "python")
_INTERPRETER_FUNCS = ("PyEval", "PyGILState", "take_gil", "_Py", "Py_")


def _parked_native_worker(th: ThreadEvidence, t: ThreadView) -> str | None:
    """The library whose own worker thread ``th`` is, when its whole native stack says it never ran anything
    else: started by pthread_create into that one library, which parks it in an untimed condvar or futex wait
    (OpenBLAS's and a Rust thread pool's workers between jobs). None where the stack says more: frames of the
    interpreter, of a second library, a mutex (whose holder it waits for), or no native frames read."""
    if t.kind not in (WaitKind.COND_WAIT, WaitKind.FUTEX_WAIT) or t.timed:
        return None
    native = [f for f in th.frames if f.kind == "native"]
    if not native or not any(f.name in ("start_thread", "clone3", "clone") or "pthread_create" in (f.file or "")
                             for f in native[-3:]):
        return None
    libs: set[str] = set()
    for f in native:
        where_ = f.library or f.file or ""
        base = where_.rsplit("/", 1)[-1]
        if base.startswith(_INTERPRETER_FILES) or any(s in f.name for s in _INTERPRETER_FUNCS):
            return None
        if base and not any(s in where_ for s in _LIBC) and not where_.startswith((".", "../")):
            libs.add(base)
    return next(iter(libs)) if len(libs) == 1 else None


_SIGCHLD = 17   # Linux, x86_64 and aarch64 alike


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _long_sleep(x: Wait) -> bool:
    """A main thread with so long left to sleep (its timespec, read from memory) that it completes nothing the
    capture saw stuck: a keep-alive ``while True: sleep(3600)`` while the work runs on other threads. A worker
    thread's long sleep is work in flight (a join waits for it to end), so it still counts."""
    ms = x.th.wait_timeout_ms
    return x.view.is_main and x.view.kind is WaitKind.SLEEP and ms is not None and ms >= LONG_SLEEP_S * 1000


def _completer(x: Wait) -> bool:
    """It runs, sleeps (not for long) or waits with a timeout, or waits on something nobody can name."""
    if _long_sleep(x):
        return False
    return x.purpose in (WaitPurpose.RUNNING, WaitPurpose.OTHER) or x.view.kind is WaitKind.SLEEP or (
        x.view.timed and x.view.kind is not WaitKind.GIL_WAIT)


def _self_fed(w: Wait) -> bool:
    """A read, or a poll with no timeout, only on pipes or socketpairs whose other end no process but its own
    holds (no listening socket, no signal it waits to be told by): only another thread of it can feed it."""
    fds = w.th.blocked_fds
    if w.view.kind not in (WaitKind.IO_READ, WaitKind.EVENT_WAIT) or not fds:
        return False
    if w.view.kind is WaitKind.EVENT_WAIT and (not w.view.wait_forever or wake_signals(w.proc)):
        return False
    # A pipe with no writer outside its process still blocks a reader only while its own process holds the
    # write end (with no writer at all the read would end): the holders scan names other processes only.
    # A message queue has no end-of-file: with no other process that may send, only its own threads can. An
    # eventfd is written by whoever holds it: its own threads, or a child that inherited it.
    alone = set(w.proc.children or ()) <= set(w.proc.exited_children or ())
    return all(_self_pair(f, w.proc.pid) or (f.kind in ("pipe", "mqueue") and f.writer_pids == [])
               or (alone and f.kind == "anon" and "eventfd" in f.target) for f in fds)


def process_waits(proc: ProcessEvidence, machine: str | None = None) -> list[Wait]:
    if not proc.alive or not proc.threads:
        return []
    out = [classify_wait(proc, th, t, machine)
           for th, t in zip(proc.threads, classify_process(proc, machine), strict=False)]
    # A thread fed only by its own process waits for work while another thread of it may still act (take new
    # work, run, sleep, time out); when none can, nothing will ever be written: it waits for an outcome.
    for w in out:
        if _self_fed(w) and w.purpose is not WaitPurpose.OUTCOME and not any(
                x is not w and (x.purpose is WaitPurpose.NEW_WORK or (_completer(x) and not _self_fed(x)))
                for x in out):
            w.purpose = WaitPurpose.OUTCOME
            how = "a poll on descriptors" if w.view.kind is WaitKind.EVENT_WAIT else "a read of a pipe or queue"
            w.what = (f"{how} only its own process writes, while no other thread of it can act "
                      f"({_frames_text(w.view)})")
    for w in out:
        if w.purpose is WaitPurpose.OUTCOME and w.in_process:
            w.may_be_completed = any(x is not w and _completer(x) for x in out)
    return out


def idle_new_work(proc: ProcessEvidence, machine: str | None = None) -> set[int]:
    """Threads of ``proc`` waiting for new work that did not advance over an observed window (empty when the
    window did not observe the process)."""
    if not observed([proc]):
        return set()
    return {w.th.tid for w in process_waits(proc, machine) if w.purpose is WaitPurpose.NEW_WORK and w.advanced is False}


def thread_waits(bundle: Bundle) -> list[ThreadWait]:
    """Every captured thread's wait purpose, as the reports show it."""
    machine = bundle.host.machine
    out: list[ThreadWait] = []
    for p in bundle.processes:
        for w in process_waits(p, machine):
            out.append(ThreadWait(pid=p.pid, node=p.node, tid=w.th.tid, name=w.th.name, purpose=w.purpose,
                                  what=w.what, advanced=w.advanced, stuck=w.stuck))
    return out


# ------------------------------------------------------------------ what advanced


def _spinner(p: ProcessEvidence, th: ThreadEvidence) -> bool:
    """A thread whose only advance is CPU spent napping in a loop on shared memory that did not change."""
    o = th.observed
    if o is None or p.progress is None or not p.shared_maps:
        return False
    if any(p.progress.shared_changed.values()) or any(n > 0 for n in o.io_delta.values()):
        return False
    return (o.voluntary_switches or 0) >= _SPIN_SWITCHES


def _advanced(procs: list[ProcessEvidence], waits: dict[int, list[Wait]] | None = None) -> list[str]:
    """What moved in the window, one phrase each (empty: nothing)."""
    out: list[str] = []
    for ws in (waits or {}).values():
        out += [f"thread {w.th.tid} of pid {w.proc.pid} was woken in an untimed wait" for w in ws if w.woke]
    for p in procs:
        pr = p.progress
        if pr is None:
            continue
        grew = [path.rsplit("/", 1)[-1] for path, n in pr.log_growth.items() if n > 0]
        if grew:
            out.append(f"pid {p.pid} wrote its log ({', '.join(grew)})")
        if any(pr.io_delta.get(k, 0) > 0 for k in ("rchar", "wchar", "syscr", "syscw")):
            out.append(f"pid {p.pid} did I/O")
        if any(pr.shared_changed.values()):
            out.append(f"pid {p.pid}'s shared memory changed")
        ended = _ended(p)
        if ended and len(ended) == len(p.threads):
            out.append(f"pid {p.pid} exited during the window")
        elif ended:
            out.append(f"thread {ended[0]} of pid {p.pid} ended during the window")
        mine = {w.th.tid: w for w in (waits or {}).get(p.pid, [])}
        for th in p.threads:
            moved = mine[th.tid].advanced if th.tid in mine else th.observed is not None and th.observed.advanced
            if moved and not _spinner(p, th):
                out.append(f"thread {th.tid} of pid {p.pid} ran")
    return out


def spinners_on(bundle: Bundle, pids: set[int]) -> list[str]:
    """Sentences for threads that spin (nap, wake, look) on a shared mapping whose bytes did not change over the
    window while a process in ``pids`` maps the same file: a reader waiting on a writer that is stuck."""
    out: list[str] = []
    by_pid = {p.pid: p for p in bundle.processes}
    for p in bundle.processes:
        if p.pid in pids or not p.shared_maps or p.progress is None:
            continue
        for th in p.threads:
            if not _spinner(p, th):
                continue
            for m in p.shared_maps:
                key = f"{m.dev}:{m.inode}"
                if p.progress.shared_changed.get(key, True):
                    continue
                writers = [q for q in pids if q in by_pid and any(
                    (x.dev, x.inode) == (m.dev, m.inode) for x in by_pid[q].shared_maps or [])]
                if writers:
                    out.append(f"pid {p.pid} thread {th.tid} spins on the shared mapping {m.path or key}, whose bytes "
                               f"did not change over the window; pid {writers[0]}, which maps it too, is the one "
                               "stuck above")
                    break
    return out


def observed(procs: list[ProcessEvidence]) -> bool:
    """Every live process was watched over the window and its threads observed one by one (a thread gone by
    the second sample was observed too: it ended, see :func:`_ended`)."""
    live = [p for p in procs if p.alive and p.threads]
    return bool(live) and all(p.progress is not None for p in live)


def _ended(p: ProcessEvidence) -> list[int]:
    """Threads of ``p`` seen at the window's first sample and gone by its second: they ended (a process that
    exited in the window, a worker thread that finished), which is progress."""
    return [t.tid for t in p.threads if t.observed is None] if p.progress is not None else []


def progress_seen(procs: list[ProcessEvidence], machine: str | None = None) -> list[str] | None:
    """What advanced in ``procs`` over the window, one phrase each (empty: nothing); None when the window did
    not observe every live one."""
    live = [p for p in procs if p.alive and p.threads]
    if not observed(live):
        return None
    return _advanced(live, {p.pid: process_waits(p, machine) for p in live})


def ends_by_itself(procs: list[ProcessEvidence], machine: str | None = None) -> bool:
    """Some thread of ``procs`` sleeps (not for long) or waits with a timeout: quiet now, it may go on by
    itself (a loader asleep between shards)."""
    return any(not _long_sleep(w) and (w.view.kind is WaitKind.SLEEP or
                                       (w.view.timed and w.view.kind is not WaitKind.GIL_WAIT))
               for p in procs for w in process_waits(p, machine))


def health_basis(procs: list[ProcessEvidence], machine: str | None = None) -> tuple[str, bool]:
    """What a healthy verdict over ``procs`` rests on, in words, and whether it was earned: progress observed
    in the window (a thread ran, a process did I/O or wrote its log), or every blocked thread waiting for new
    work (an idle service). Neither: the stacks show no hang pattern, and that is all that is known."""
    live = [p for p in procs if p.alive and p.threads]
    if not observed(live):
        # Where a sample happened to catch a thread (on a CPU or not) is timing, not progress.
        return "the stacks show no hang pattern; progress was not observed (no window)", False
    waits = {p.pid: process_waits(p, machine) for p in live}
    moved = _advanced(live, waits)
    if moved:
        more = f" and {len(moved) - 3} more" if len(moved) > 3 else ""
        return f"progress observed in the window: {'; '.join(moved[:3])}{more}", True
    every = [w for ws in waits.values() for w in ws]
    if every and all(w.purpose is WaitPurpose.NEW_WORK for w in every):
        kinds = list(dict.fromkeys(w.what.split(" (", 1)[0] for w in every))
        return (f"idle: all {len(every)} thread(s) wait for new work ({', '.join(kinds[:4])})", True)
    waiting = [w for w in every if w.purpose is not WaitPurpose.NEW_WORK]
    return (f"the stacks show no hang pattern, but nothing was seen to advance: {len(waiting)} thread(s) wait "
            f"for something other than new work ({waiting[0].what}{', ...' if len(waiting) > 1 else ''})", False)


# ------------------------------------------------------------------ the chain


@dataclass
class _Step:
    text: str
    kind: VerdictKind
    cite: list[Wait]
    live: bool = False     # the chain ends at a process that may still act: not a hang
    cycle: bool = False    # the chain came back to a process already on it


def _may_act(ws: list[Wait]) -> bool:
    """A thread that runs, sleeps or waits with a timeout (a one-shot sleep ends and may finish the work; one
    window cannot tell it from a timer loop), or waits on something nobody can name."""
    return any(_completer(x) for x in ws)


class _Chain:
    def __init__(self, bundle: Bundle, waits: dict[int, list[Wait]]) -> None:
        self.bundle = bundle
        self.waits = waits
        self.by_pid = {p.pid: p for p in bundle.processes}

    def label(self, pid: int) -> str:
        p = self.by_pid.get(pid)
        return f"pid {pid} ({p.comm})" if p is not None and p.comm else f"pid {pid}"

    def doing(self, pid: int, seen: set[int], depth: int) -> _Step:
        """What process ``pid`` is doing, as deep as the evidence reaches."""
        if pid not in self.by_pid:
            return _Step(f"{self.label(pid)} was not captured", VerdictKind.UNKNOWN, [])
        p = self.by_pid[pid]
        if not p.alive:
            return _Step(f"{self.label(pid)} is gone", VerdictKind.BLOCKED_IPC_READ, [])
        if pid in seen:
            return _Step(f"and so back to {self.label(pid)}: a cycle, nobody moves", VerdictKind.UNKNOWN, [],
                         cycle=True)
        ws = self.waits.get(pid, [])
        stuck = [w for w in ws if w.stuck]
        # A read whose writers are all already on this chain (they wait, directly or not, for this process)
        # will not be fed: it is the chain's way back, not a thread that may still act.
        fed_back = [w for w in ws if _completer(w) and (pe := _peers(w)) and set(pe) - {pid}
                    and set(pe) - {pid} <= seen]
        acting = [w for w in ws if _completer(w) and w not in fed_back]
        if fed_back and not acting and not stuck and depth < 4:
            return self.step(fed_back[0], seen | {pid}, depth + 1)
        if _may_act(ws) and not stuck:
            return _Step(f"{self.label(pid)} may still act", VerdictKind.UNKNOWN, [], live=True)
        if stuck and depth < 4:
            w = sorted(stuck, key=lambda x: (x.in_process, not x.view.is_main, x.th.tid))[0]
            return self.step(w, seen | {pid}, depth + 1)
        if ws and all(w.purpose is WaitPurpose.NEW_WORK for w in ws):
            first = next((w for w in ws if w.view.is_main), ws[0])
            if first.th.wait_signals:
                return _Step(f"{self.label(pid)} waits for a signal (its main thread in {first.what}); none of the "
                             "processes on this chain will send it", VerdictKind.UNKNOWN, [first])
            return _Step(f"{self.label(pid)} is idle, waiting for new work (its main thread in {first.what}): the "
                         "request it should answer was lost", VerdictKind.BLOCKED_IPC_READ, [first])
        return _Step(f"{self.label(pid)} shows no wait that would complete it", VerdictKind.UNKNOWN, ws[:1])

    def fork_of(self, w: Wait) -> str | None:
        """Why nothing in a forked child will wake a thread-pool wait: the pool's threads were not copied."""
        parent = self.by_pid.get(w.proc.ppid or -1)
        if parent is None or parent.cmdline != w.proc.cmdline or parent.exe != w.proc.exe:
            return None
        if not any(s in f.name for f in w.th.frames[:24] for s in _POOL_FRAMES):
            return None
        n = len(w.proc.threads)
        return (f"{self.label(w.proc.pid)} is a fork of {self.label(parent.pid)} (same program, not exec'ed) and has "
                f"{n} thread{'s' if n != 1 else ''}; the runtime's thread team it waits for was not copied by fork: "
                f"those threads exist only in the parent ({len(parent.threads)} threads), so nothing will wake it")

    def step(self, w: Wait, seen: set[int], depth: int) -> _Step:
        who = f"{self.label(w.proc.pid)} thread {w.th.tid}" + (f" ({w.th.name})" if w.th.name else "")
        kw = w.th.kernel_wait
        if kw is not None and kw.what == "fifo_open":
            if not kw.holder_pids:
                end = "writer" if kw.access != "write" else "reader"
                return _Step(f"{who} waits in {w.what}; no process has the FIFO open, so no {end} will ever come",
                             VerdictKind.BLOCKED_IPC_READ, [w])
            nxt = self.doing(kw.holder_pids[0], seen, depth)
            return _Step(f"{who} waits in {w.what}; it is held open by {self.label(kw.holder_pids[0])}; {nxt.text}",
                         nxt.kind, [w, *nxt.cite], nxt.live, nxt.cycle)
        if kw is not None:
            if not kw.holder_pids:
                return _Step(f"{who} waits in {w.what}; /proc/locks names no holder (a lock taken and released "
                             "in a race, or one held through an open file description)", VerdictKind.UNKNOWN, [w])
            holder = kw.holder_pids[0]
            nxt = self.doing(holder, seen, depth)
            return _Step(f"{who} waits in {w.what}, held by pid {holder}; {nxt.text}", nxt.kind, [w, *nxt.cite],
                         nxt.live, nxt.cycle)
        if w.th.waited_pid is not None and w.th.waited_pid > 0:
            nxt = self.doing(w.th.waited_pid, seen, depth)
            return _Step(f"{who} waits in {w.what}; {nxt.text}", nxt.kind, [w, *nxt.cite], nxt.live, nxt.cycle)
        peers = _peers(w)
        if peers is not None:
            others = [q for q in peers if q != w.proc.pid]
            if not others:
                return _Step(f"{who} waits in {w.what}; the only process holding the other end is itself, and "
                             "none of its threads will write it", VerdictKind.BLOCKED_IPC_READ, [w])
            nxt = self.doing(others[0], seen, depth)
            if w.th.write_fds:
                only = "only " if len(others) == 1 else ""
                return _Step(f"{who} waits in {w.what}, which {only}{', '.join(self.label(q) for q in others)} "
                             f"reads; {nxt.text}", nxt.kind, [w, *nxt.cite], nxt.live, nxt.cycle)
            return _Step(f"{who} waits in {w.what} from {self.label(others[0])}; {nxt.text}", nxt.kind,
                         [w, *nxt.cite], nxt.live, nxt.cycle)
        if (w.view.kind in (WaitKind.IO_READ, WaitKind.EVENT_WAIT) or w.th.write_fds) and not \
                _loop_on_itself(w.proc, w.view) and not w.th.wait_signals and not _self_fed(w):
            # A read or write whose other end was not read: whoever holds it may still answer.
            return _Step(f"{who} waits in {w.what}; who holds the other end was not read", VerdictKind.UNKNOWN,
                         [w], live=True)
        # A wait inside the process: who could complete it?
        mine = self.waits.get(w.proc.pid, [])
        # Another thread of the process stuck on something outside it (a full pipe, a peer): that is where the
        # outcome is held up (a join of a queue's feeder thread, a result a receiver thread would deliver).
        outside = [x for x in mine if x is not w and x.stuck and not x.in_process]
        if outside and depth < 6:
            nxt = self.step(outside[0], seen, depth + 1)
            return _Step(f"{who} waits in {w.what}; {nxt.text}", nxt.kind, [w, *nxt.cite], nxt.live, nxt.cycle)
        forked = self.fork_of(w)
        if forked is not None:
            return _Step(f"{who} waits in {w.what}{_native_words(w)}: {forked}", VerdictKind.LOST_WAKEUP, [w])
        rest = [x for x in mine if x is not w]
        kinds = sorted({x.purpose.value.replace("_", " ") for x in rest})
        if rest:
            also = f"its other {len(rest)} thread(s) wait too ({', '.join(kinds)}), none of them advanced"
        else:
            also = "it has no other thread"
        # A condition nobody will signal is a lost wakeup; a plain lock nobody else holds (re-taken by its own
        # holder, or held by a thread we cannot name) stays unknown.
        lost = w.view.kind is WaitKind.COND_WAIT or _loop_on_itself(w.proc, w.view) or (
            w.view.kind is WaitKind.PY_LOCK_WAIT and w.view.py_wait == "py_cond")
        kind = VerdictKind.LOST_WAKEUP if lost else VerdictKind.UNKNOWN
        return _Step(f"{who} waits in {w.what} for the outcome of work already started; no live thread can "
                     f"complete it: {also}", kind, [w])


def _cycle_kind(cite: list[Wait]) -> VerdictKind:
    """A cycle's kind by its edges: one through a read of a pipe or socket is a blocked read; one made only of
    locks (file locks, lock waits) is a lock-order inversion; anything else (a waitpid, a join) names no
    dedicated kind."""
    if any(w.view.kind in (WaitKind.IO_READ, WaitKind.EVENT_WAIT) or w.th.write_fds or
           (w.th.kernel_wait is not None and w.th.kernel_wait.what == "fifo_open") for w in cite):
        return VerdictKind.BLOCKED_IPC_READ
    locks = [w for w in cite if (w.th.kernel_wait is not None and w.th.kernel_wait.what != "fifo_open")
             or w.view.kind in (WaitKind.PY_LOCK_WAIT, WaitKind.MUTEX_WAIT)]
    if cite and len(locks) == len(cite):
        return VerdictKind.LOCK_ORDER_INVERSION
    return VerdictKind.UNKNOWN


def _peers(w: Wait) -> list[int] | None:
    """Who holds the other end of the socket or pipe a reply-read (or a blocked write) waits on (None: not such
    a wait, or unread)."""
    if w.th.write_fds:
        f = w.th.write_fds[0]
        pids = (f.reader_pids if f.reader_pids is not None else f.peer_pids) if f.kind == "pipe" else f.peer_pids
        return list(pids) if pids is not None else None
    if w.view.kind not in (WaitKind.IO_READ, WaitKind.EVENT_WAIT):
        return None
    out: list[int] = []
    read = False
    for f in w.th.blocked_fds:
        # A loop's own wakeup pipe is no peer: who writes it is a thread of the same process.
        if f.kind not in ("socket", "pipe", "mqueue") or f.listening or (
                w.view.kind is WaitKind.EVENT_WAIT and _self_pair(f, w.proc.pid)):
            continue
        pids = (f.writer_pids if f.writer_pids is not None else f.peer_pids) if f.kind in ("pipe", "mqueue") \
            else f.peer_pids
        if pids is None:
            continue
        read = True
        out += [q for q in pids if q not in out]
    return out if read else None


def _cite(w: Wait, role: str, engine: str | None, keys: tuple[Key, ...]) -> EvidenceItem:
    """The thread's citation; a wait no frame names as blocking (a write into a full pipe) rests on its
    innermost Python call."""
    item = cited(w.view, role, engine, keys)
    if item.frames and not item.key_frames:
        py = next((i for i, f in enumerate(w.view.frames) if f.kind == "python"), None)
        if py is not None:
            rows = [(i, v.describe(f)) for i, f in enumerate(w.view.frames[:py + 1])][-6:]
            item = item_of(w.view.pid, w.view.tid, role, engine, rows, {py})
    return item


_LOG_PID = re.compile(r"\bpid[= ](\d+)")


def _gone_in_log(bundle: Bundle, scope: list[ProcessEvidence]) -> list[int]:
    """Pids the engines' logs name that are not among the captured live processes (a dead producer)."""
    alive = {p.pid for p in scope if p.alive}
    out: list[int] = []
    for e in bundle.engines:
        for line in e.log_tail:
            out += [int(m) for m in _LOG_PID.findall(line) if int(m) not in alive and int(m) not in out]
    return out


def stuck_outcome(bundle: Bundle, procs: list[ProcessEvidence], engine: str | None) -> Verdict | None:
    """A hang verdict when one of ``procs`` waits for an outcome that did not advance while nothing in the
    captured processes advanced; None when the window did not observe them or something moved."""
    scope = [p for p in bundle.processes if p.node == (procs[0].node if procs else None)]
    if not procs or not observed(scope):
        return None
    machine = bundle.host.machine
    waits = {p.pid: process_waits(p, machine) for p in scope}
    if _advanced(scope, waits):
        return None
    stuck = [w for p in procs for w in waits.get(p.pid, []) if w.stuck]
    if not stuck:
        return None
    # A wait on a futex in shared memory (a multiprocessing Event, Lock, Barrier) may be posted by any process;
    # while one of them may still act, it is not stuck.
    everyone = [w for ws in waits.values() for w in ws]
    # A wait inside one process may be completed by a thread that hears from another process (a pool's result
    # handler from its workers): the same holds for it.
    for w in stuck:
        receiver = any(x is not w and x.view.kind in (WaitKind.IO_READ, WaitKind.EVENT_WAIT)
                       for x in waits.get(w.proc.pid, []))
        # A thread that only naps and looks at shared memory that did not change waits itself: it posts nothing.
        if (w.view.shared_futex or (w.in_process and receiver)) and _may_act(
                [x for x in everyone if x.proc.pid != w.proc.pid and not _spinner(x.proc, x.th)]):
            w.may_be_completed = True
    stuck = [w for w in stuck if w.stuck]
    chain = _Chain(bundle, waits)
    # The wait the kernel names the other party of first, then a reply, then a process's own main thread.
    stuck.sort(key=lambda w: (w.th.kernel_wait is None, w.th.waited_pid is None, _peers(w) is None,
                              not w.view.is_main, w.th.tid))
    found = next(((w, st) for w in stuck if not (st := chain.step(w, {w.proc.pid}, 0)).live), None)
    if found is None:
        return None
    first, step = found
    if step.cycle:
        step.kind = _cycle_kind(step.cite)
    window = max((p.progress.window_s for p in scope if p.progress is not None), default=0.0)
    evidence: list[EvidenceItem] = []
    for i, w in enumerate(step.cite[:4]):
        role = f"{'waits' if i == 0 else 'then'}: {w.what} ({w.purpose.value.replace('_', ' ')}; "
        role += "did not advance)" if w.stuck else "waiting)"
        evidence.append(_cite(w, role, engine, BLOCKED_KEYS if i == 0 or w.stuck else CONTEXT_KEYS))
    others = [w for w in stuck[1:] if not any(e.pid == w.proc.pid and e.tid == w.th.tid for e in evidence)]
    evidence += [_cite(w, f"also waits: {w.what} (did not advance)", engine, CONTEXT_KEYS) for w in others[:3]]
    n = len(scope)
    gone = _gone_in_log(bundle, scope)
    if gone and step.kind in (VerdictKind.LOST_WAKEUP, VerdictKind.UNKNOWN):
        step.text += (f"; the log names pid {', '.join(map(str, gone[:3]))}, which no longer exist"
                      f"{'s' if len(gone) == 1 else ''}: a producer that died with the work it had taken")
    summary = (f"hang: {step.text}. Nothing advanced in {n} captured process{'es' if n > 1 else ''} over the "
               f"{window:.2f}s window (no CPU, I/O, log growth or shared-memory change), so the outcome it waits "
               f"for is not coming")
    reasons = ["+ every thread observed twice over the window: none used CPU, did I/O or changed syscall",
               "+ the wait is for the outcome of work already started, not for new work"]
    if step.kind is VerdictKind.UNKNOWN:
        reasons.append("- who would complete the wait could not be named: a stack with locals (pystack --locals) "
                       "or the peer's capture would decide")
    findings = [Finding(kind="stuck_outcome", pid=w.proc.pid, engine=engine,
                        message=f"pid {w.proc.pid} thread {w.th.tid} waits in {w.what}; it did not advance")
                for w in stuck[:6]]
    return Verdict(kind=step.kind, confidence=Confidence.MEDIUM if step.kind is not VerdictKind.UNKNOWN else
                   Confidence.LOW, engine=engine, evidence=evidence, summary=summary, confidence_reasons=reasons,
                   findings=findings)


def lock_after_death(bundle: Bundle, procs: list[ProcessEvidence], engine: str | None, line: str) -> Verdict | None:
    """A live process whose log ends with an exception (``line``) while one of its threads waits with no
    timeout on a lock or condition that did not advance and none of its threads runs (the others sleep in timer
    loops or wait): the thread that died may have held what it waits for. A hang whose waker cannot be named;
    the exception is its finding, not its verdict."""
    if not observed(procs):
        return None
    machine = bundle.host.machine
    for p in procs:
        ws = process_waits(p, machine)
        if any(w.purpose is WaitPurpose.RUNNING for w in ws):
            continue
        held = [w for w in ws if w.purpose is WaitPurpose.OUTCOME and w.view.kind in _BLOCKING and not w.view.timed
                and w.advanced is False and not w.woke and w.in_process]
        if not held:
            continue
        w = sorted(held, key=lambda x: (not x.view.is_main, x.th.tid))[0]
        who = f"pid {p.pid} thread {w.th.tid}" + (f" ({w.th.name})" if w.th.name else "")
        rest = [x for x in ws if x is not w]
        also = (f"its other {len(rest)} thread(s) only sleep in timer loops or wait" if rest else
                "it has no other thread")
        died = (f"a thread died with an exception ({line.strip()[:160]}); a lock it held may never be "
                "released")
        return Verdict(
            kind=VerdictKind.UNKNOWN, confidence=Confidence.LOW, engine=engine,
            evidence=[_cite(w, f"waits: {w.what} (outcome; no timeout, did not advance)", engine, BLOCKED_KEYS)],
            summary=(f"hang: {who} waits in {w.what} with no timeout and did not advance; {also}; the log says "
                     f"{died}"),
            confidence_reasons=["+ the wait has no timeout and did not advance over the window",
                                "- who holds what it waits for could not be named: pystack --locals would show the "
                                "lock's owner"],
            findings=[Finding(kind="thread_died", pid=p.pid, engine=engine, message=died)])
    return None
