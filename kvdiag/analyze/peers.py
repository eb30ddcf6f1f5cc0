"""The cross-process peer judge: a process blocked reading from a peer is judged with that peer's
verdict (a silent peer that is itself hung, paused or healthy), never alone.
"""

from __future__ import annotations

from kvdiag.analyze.access import judgeable
from kvdiag.analyze.classify import WaitKind, classify_process
from kvdiag.analyze.process import analyze_process
from kvdiag.analyze.rulekit import STACKS_ONLY, TARGET_STATES
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import ProcessRole, VerdictKind
from kvdiag.model.verdict import Verdict


def read_peers(proc: ProcessEvidence, verdict: Verdict) -> list[int]:
    """The processes a blocked-read verdict waits on: the peers of the connections of the thread it cites."""
    if verdict.kind is not VerdictKind.BLOCKED_IPC_READ or not verdict.evidence:
        return []
    tid = verdict.evidence[0].tid
    th = next((t for t in proc.threads if t.tid == tid), None)
    if th is None:
        return []
    return sorted({q for f in th.blocked_fds if f.kind in ("socket", "pipe") and not f.listening
                   for q in f.peer_pids if q != proc.pid})


class PeerJudge:
    """Each captured process's own verdict, and who a blocked read really waits on.

    A read whose peer is another captured process that is itself hung (or stopped) is a
    consequence: an API server's loop waiting on its EngineCore, a client waiting on a server
    stuck in a GIL cycle. The verdict belongs to the process at the end of that chain. A chain
    that comes back to where it started is a real cross-process wait cycle and stands.
    """

    def __init__(self, bundle: Bundle, machine: str | None) -> None:
        self.machine = machine
        self.by_pid = {p.pid: p for p in bundle.processes}
        self.findings = bundle.findings
        self.engines = {e.name for e in bundle.engines}
        self._cache: dict[int, Verdict | None] = {}

    def verdict(self, pid: int) -> Verdict | None:
        if pid not in self._cache:
            p = self.by_pid[pid]
            self._cache[pid] = analyze_process(p, self.machine, p.engine) if judgeable([p], self.findings) else None
        return self._cache[pid]

    def hung_root(self, pid: int, seen: frozenset[int]) -> tuple[int, Verdict] | None:
        """(pid, verdict) of the hung process that ``pid``'s wait ends at; None if it is not hung or the
        chain of reads cycles back into ``seen``."""
        v = self.verdict(pid)
        if v is None or not (v.kind.is_hang or v.kind in TARGET_STATES):
            return None
        for q in read_peers(self.by_pid[pid], v):
            if q in seen:
                return None
            if q in self.by_pid and (root := self.hung_root(q, seen | {pid})) is not None:
                return root
        return pid, v

    def defer(self, proc: ProcessEvidence, verdict: Verdict) -> tuple[int, Verdict] | None:
        """The hung peer ``proc``'s blocked read waits on, when one was captured."""
        for q in read_peers(proc, verdict):
            if q in self.by_pid and (root := self.hung_root(q, frozenset({proc.pid}))) is not None:
                return root
        return None

    def live_producers(self, proc: ProcessEvidence, verdict: Verdict) -> list[int]:
        """The writers of the pipes a blocked-read verdict waits on, when every such pipe has one that is
        alive, has written before and sleeps in a timer loop (or runs): a slow producer the window fell between
        two writes of, not a silent peer. Empty when any pipe's writers are unknown, gone or stuck."""
        if verdict.kind is not VerdictKind.BLOCKED_IPC_READ or not verdict.evidence:
            return []
        tid = verdict.evidence[0].tid
        th = next((t for t in proc.threads if t.tid == tid), None)
        pipes = [f for f in th.blocked_fds if f.kind == "pipe"] if th is not None else []
        if th is None or not pipes or len(pipes) != len([f for f in th.blocked_fds if f.kind in ("pipe", "socket")]):
            return []
        out: list[int] = []
        for f in pipes:
            writers = [q for q in (f.writer_pids if f.writer_pids is not None else f.peer_pids) if q != proc.pid]
            live = [q for q in writers if self._producing(q)]
            if not live:
                return []
            out += [q for q in live if q not in out]
        return out

    def _producing(self, pid: int) -> bool:
        p = self.by_pid.get(pid)
        if p is None or not p.alive or not p.threads or p.progress is None or not p.progress.writes_total:
            return False
        return any(t.running or t.kind is WaitKind.SLEEP or (t.timed and t.kind is not WaitKind.GIL_WAIT)
                   for t in classify_process(p, self.machine))

    def waits_on_own_engine(self, proc: ProcessEvidence, verdict: Verdict) -> list[int]:
        """The peers, when ``proc`` is a part of an engine (API server, EngineCore, worker) whose read
        waits only on other captured parts of the same engine and none of them is hung: an API server
        waiting for its engine's output, an EngineCore waiting for its next request. Not a hang."""
        if proc.role is ProcessRole.OTHER or not proc.engine:
            return []
        peers = read_peers(proc, verdict)
        mine = [q for q in peers if q in self.by_pid and self.by_pid[q].engine == proc.engine
                and self.by_pid[q].role is not ProcessRole.OTHER]
        if not peers or len(mine) != len(peers):
            return []
        if any(self.hung_root(q, frozenset({proc.pid})) is not None for q in mine):
            return []
        return mine


def servers_were_paused_too(v: Verdict, proc: ProcessEvidence, bundle: Bundle, machine: str | None) -> Verdict:
    """A reply wait judged from stacks alone stands only if no other captured process waits for requests:
    such a process may be its server, paused by kvdiag's own tools at the instants the reader's stacks were
    taken (a request then sits unread and the client waits for its answer). Else: inconclusive."""
    servers = [p.pid for p in bundle.processes if p.pid != proc.pid and p.threads and any(
        t.read_role == "request" for t in classify_process(p, machine))]
    if not servers:
        return v
    who = ", ".join(f"pid {q}" for q in servers[:3])
    return v.model_copy(update={
        "kind": VerdictKind.INCONCLUSIVE,
        "confidence_reasons": [r for r in v.confidence_reasons if r != STACKS_ONLY] + [
            f"- {who} of this capture wait(s) for requests: possibly its server, paused by kvdiag's own tools "
            "while the reader's stacks were taken"],
        "summary": (f"inconclusive: {v.summary.removeprefix('blocked IPC read in ')}; but {who} of this capture "
                    "wait(s) for requests and may be its server, paused by kvdiag's own stack tools at the instants "
                    "the reader was sampled: without /proc's fd peers and sample window the wait cannot be told "
                    "from that")})
