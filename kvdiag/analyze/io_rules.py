"""The I/O rules: a thread blocked reading a socket, pipe or queue whose peer is silent, and a wait
whose other end could not be read.
"""

from __future__ import annotations

from kvdiag.analyze.classify import ThreadView, WaitKind
from kvdiag.analyze.evidence import BLOCKED_KEYS, CONTEXT_KEYS, where
from kvdiag.analyze.rulekit import (
    STACKS_ONLY,
    WAIT_WORDS,
    cited,
    missing_evidence,
    peer_phrase,
    place,
    possible_signallers,
    proc_missing,
)
from kvdiag.model.evidence import FdInfo, ProcessEvidence
from kvdiag.model.kinds import Confidence, VerdictKind
from kvdiag.model.verdict import Verdict


def _awaits_orders(t: ThreadView, proc: ProcessEvidence) -> bool:
    """The read waits for the next request or command, not for a reply: every connection it waits on
    is the server end of an accepted connection, or leads to the process's parent (a worker waiting
    for its next task)."""
    conns = [f for f in t.blocked_fds if f.kind in ("socket", "pipe") and not f.listening]
    # A pipe's writers, when read, say it better than every holder of either end.
    return bool(conns) and all(f.accepted or (proc.ppid is not None and (
        f.writer_pids if f.kind == "pipe" and f.writer_pids is not None else f.peer_pids) == [proc.ppid])
        for f in conns)


def _loop_parked(t: ThreadView, pid: int) -> list[FdInfo] | None:
    """An event loop waiting with no timeout on connections only (no listening socket, no timer):
    the connected sockets/pipes it waits on, each with a peer, else None."""
    if t.kind is not WaitKind.EVENT_WAIT or not t.wait_forever or not t.blocked_fds:
        return None
    if any(f.listening or f.kind not in ("socket", "pipe") for f in t.blocked_fds):
        return None
    outside = [f for f in t.blocked_fds if f.peer_pids and f.peer_pids != [pid]]
    return outside or None


def rule_blocked_read(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    if any(t.running and not t.idle_by_design for t in views):
        return None
    if proc.progress is not None and proc.progress.advanced:
        return None   # it wrote its log or did I/O during the window: something still moves
    # A read only the stacks saw, where /proc had found the thread in something else moments before (asleep
    # between requests, say), is a thread that moved: not parked for good.
    readers = [t for t in views if t.kind is WaitKind.IO_READ and not t.idle_by_design and not t.tty_read
               and not t.woke and not _awaits_orders(t, proc) and t.read_role != "request"
               and not t.proc_saw_other and not t.samples_moved]
    loops = [(t, fds) for t in views if not t.idle_by_design and not t.woke and not _awaits_orders(t, proc)
             and t.read_role != "request" and (fds := _loop_parked(t, proc.pid))]
    if not readers and loops and not possible_signallers(views, [t for t, _ in loops]):
        t, fds = loops[0]
        what = "asyncio event loop" if t.asyncio_loop else "event loop"
        on = "; ".join(peer_phrase(f) for f in fds[:3])
        return Verdict(kind=VerdictKind.BLOCKED_IPC_READ, confidence=Confidence.MEDIUM, engine=engine,
                       evidence=[cited(t, f"{what} parked with no timeout, waiting only on {on}", engine,
                                            BLOCKED_KEYS)],
                       summary=(f"blocked IPC read in {place(proc)}: the {what} in {t.label} is parked in "
                                f"{t.wait_frame or 'epoll_wait'}{where(t)} with no timeout and no timer; its only "
                                f"event sources are connections that stay silent: {on}. The awaiting coroutine is not "
                                f"on any stack; it is the read on that connection"))
    if not readers:
        return None
    # A background reader thread is a receive loop (a server's input thread, an engine's output reader)
    # while another thread still acts: an event loop, a thread in a timed wait, one that woke. Only a
    # main thread (or the GIL holder) stuck in the read, or a reader nobody else can outlive, is a hang.
    event_loops = [t for t in views if t.kind is WaitKind.EVENT_WAIT and not t.idle_by_design]
    others_act = bool(event_loops) or bool(possible_signallers(views, readers, proc))
    picked = [t for t in readers if t.is_main or t.holds_gil or not others_act]
    if not picked:
        return None
    r = sorted(picked, key=lambda t: (not t.holds_gil, not t.is_main, t.tid))[0]
    from_frames = r.wait_frame is not None and not r.wait_frame.startswith(("wchan", "syscall"))
    conns = [f for f in r.blocked_fds if f.kind in ("socket", "pipe", "mqueue")]
    if not conns and not r.proc_saw_read:
        # Neither the fd's peer nor the sample window covers this read (it came from the stacks alone).
        return unresolved_read(proc, r, engine)
    is_socket = r.socket_read or any(f.kind == "socket" for f in conns)
    conf = Confidence.HIGH if (from_frames and (is_socket or conns)) else Confidence.MEDIUM
    what = peer_phrase(conns[0]) if conns else ("a socket" if r.socket_read else "a socket/pipe")
    evidence = [cited(r, f"blocked reading {what} with no timeout" + (" (holds the GIL)" if r.holds_gil else ""),
                      engine, BLOCKED_KEYS)]
    others = [t for t in views if t.tid != r.tid and not t.idle_by_design and t.kind in (
        WaitKind.PY_LOCK_WAIT, WaitKind.COND_WAIT, WaitKind.GIL_WAIT)]
    evidence += [cited(t, f"also blocked ({WAIT_WORDS.get(t.kind, t.kind.value)})", engine, CONTEXT_KEYS)
                 for t in others[:3]]
    return Verdict(kind=VerdictKind.BLOCKED_IPC_READ, confidence=conf, engine=engine, evidence=evidence,
                   summary=(f"blocked IPC read in {place(proc)}: {r.label} waits for data on {what}"
                            f"{where(r)} and no thread of the process is running"))


def unresolved_read(proc: ProcessEvidence, r: ThreadView, engine: str | None) -> Verdict:
    """A blocked read whose fd (and so its peer) is unknown: a client waiting for a reply that never comes
    and a server waiting for its next request look the same. Judged only when the Python frames say it
    waits for a reply and at least two stack tools found it in that read; otherwise inconclusive, naming
    what is missing."""
    missing = missing_evidence(proc)
    if r.read_role == "reply" and r.samples_in_wait >= 2 and not r.samples_moved:
        return Verdict(kind=VerdictKind.BLOCKED_IPC_READ, confidence=Confidence.LOW, engine=engine,
                       evidence=[cited(r, "blocked reading with no timeout, waiting for a reply (from its frames; "
                                          f"{r.samples_in_wait} stack sample(s) in the same read)", engine,
                                      BLOCKED_KEYS)],
                       confidence_reasons=[f"- {missing}", "+ its frames are a client call waiting for a reply",
                                           f"+ {r.samples_in_wait} stack tools found it in the same read",
                                           STACKS_ONLY],
                       summary=(f"blocked IPC read in {place(proc)}: {r.label} waits for a reply{where(r)} and no "
                                f"thread of the process is running; judged from its stacks only: {missing}"))
    what = {"reply": "its frames are a client call waiting for a reply, but only one stack sample shows it",
            None: "its frames do not say whether it waits for a reply or for the next request"}.get(r.read_role, "")
    return Verdict(kind=VerdictKind.INCONCLUSIVE, confidence=Confidence.LOW, engine=engine,
                   evidence=[cited(r, "blocked reading with no timeout (peer unknown)", engine, BLOCKED_KEYS)],
                   confidence_reasons=[f"- {missing}", f"- {what}"],
                   summary=(f"inconclusive: in {place(proc)}, {r.label} blocks reading with no timeout{where(r)} "
                            f"and nothing else of the process runs, but {what}: an idle server and a client whose "
                            f"peer stopped answering look the same here. Missing: {missing}. Capture again with "
                            f"/proc readable (kvdiag's proc backend) to decide"))


def rule_unresolved_wait(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    """An event loop (poll/epoll/select, not accept) parked with a timeout and fds that were not read (no
    /proc), nothing else of the process able to act: idle with no clients, or an asyncio client awaiting a
    reply (the coroutine is on no stack). Neither healthy nor a deadlock: inconclusive."""
    if not proc_missing(proc) or any(t.running and not t.idle_by_design for t in views):
        return None
    loops = [t for t in views if t.kind is WaitKind.EVENT_WAIT and not t.idle_by_design and not t.timed
             and t.read_role is None and not t.blocked_fds and "accept" not in (t.wait_frame or "")
             and "sig" not in (t.wait_frame or "") and "pause" not in (t.wait_frame or "")]
    if not loops:
        return None
    others = [t for t in possible_signallers(views, loops, proc) if t.kind is not WaitKind.EVENT_WAIT]
    if others:
        return None
    t = sorted(loops, key=lambda t: (not t.is_main, t.tid))[0]
    what = "asyncio event loop" if t.asyncio_loop else "event loop"
    missing = missing_evidence(proc)
    return Verdict(kind=VerdictKind.INCONCLUSIVE, confidence=Confidence.LOW, engine=engine,
                   evidence=[cited(t, f"{what} parked; its timeout and fds unknown", engine, BLOCKED_KEYS)],
                   confidence_reasons=[f"- {missing}", "- a parked loop's coroutines are on no stack"],
                   summary=(f"inconclusive: the {what} in {t.label} of {place(proc)} is parked in "
                            f"{t.wait_frame or 'a poll'} and nothing else of the process runs; without its timeout "
                            f"and the fds it waits on, a loop idle between clients and one awaiting a reply that "
                            f"never comes look the same (the awaiting coroutine is on no stack). Missing: "
                            f"{missing}. Capture again with /proc readable to decide"))
