"""Which processes a capture may touch: the scope check behind ``kvdiag capture``, and the EngineCore selector.

A capture attaches py-spy, pystack and gdb to every process of the tree it is given. The tree of
pid 1, of a login shell or of a container's init holds the whole host (other users' programs
included): capturing it pauses unrelated processes and can name a deadlock in one of them. So a
target whose tree is not one engine is refused unless the user consents (``--all-descendants``),
and ``--engine-core-of API_SERVER_PID`` picks the EngineCore under a server the user names instead
of guessing one from a host-wide ``pgrep``.

Pure reads of /proc; nothing here signals or attaches to a process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvdiag.capture.discover import _title, classify_title
from kvdiag.model.kinds import ProcessRole
from kvdiag.osread.ptable import ancestors, process_tree
from kvdiag.osread.status import read_status

# More processes than a vLLM tree has (API server, EngineCore per DP rank, a worker per TP rank,
# resource tracker) even at 8 GPUs; a tree this big is a session or a host.
MAX_TREE = 64


def _uid(pid: int) -> int | None:
    """Real uid of ``pid`` (None when it is gone)."""
    status = read_status(pid)
    return status.uid if status is not None else None


@dataclass
class Scope:
    """The tree a capture of ``root`` would touch, and why it should not without consent."""

    root: int
    pids: list[int]
    problems: list[str]


def capture_scope(root: int, *, me: int | None = None, my_uid: int | None = None) -> Scope:
    """The processes a capture of ``root`` attaches to, and the reasons (if any) to refuse it.

    kvdiag's own process is never part of the scope. Reasons: ``root`` is pid 1;
    it is an ancestor of kvdiag (a shell or session: its tree holds kvdiag and everything else
    started from it); its tree mixes users (processes of another user than ``root``'s owner); the tree is
    larger than any engine's (:data:`MAX_TREE`).
    """
    me = os.getpid() if me is None else me
    my_uid = os.getuid() if my_uid is None else my_uid
    pids = [p for p in process_tree(root) if p != me]
    problems: list[str] = []
    if root == 1:
        problems.append("pid 1 is the init process: its tree is every process on the host")
    elif root in ancestors(me):
        problems.append(f"pid {root} is an ancestor of kvdiag itself (a shell or a session): its tree is "
                        "everything started from it")
    # The engine's owner is whoever owns the pid the user named: `sudo kvdiag capture` of another
    # user's engine is the fix no_access prints, so only a tree that mixes users needs consent.
    owner = _uid(root)
    expected = {my_uid} if owner is None else {owner}
    foreign: dict[int, int] = {}
    for pid in pids:
        uid = _uid(pid)
        if uid is not None and uid not in expected:
            foreign[uid] = foreign.get(uid, 0) + 1
    if foreign:
        who = ", ".join(f"uid {uid}: {n} process{'es' if n > 1 else ''}" for uid, n in sorted(foreign.items()))
        problems.append(f"the tree of pid {root} holds processes of other users than its owner ({who})")
    if len(pids) > MAX_TREE:
        problems.append(f"the tree of pid {root} has {len(pids)} processes, more than one engine has "
                        f"(at most {MAX_TREE})")
    return Scope(root=root, pids=pids, problems=problems)


def engine_cores_of(pid: int) -> list[int]:
    """The EngineCore processes (title ``VLLM::EngineCore``, ``EngineCore_DP<n>``) in ``pid``'s tree.

    ``pid`` itself counts when it is an EngineCore. Only the process title decides, never a log
    line or a command-line argument (an API server started with "EngineCore" in its arguments is
    not one).
    """
    return [p for p in process_tree(pid) if classify_title(*_title(p)) is ProcessRole.ENGINE_CORE]


__all__ = ["MAX_TREE", "Scope", "capture_scope", "engine_cores_of"]
