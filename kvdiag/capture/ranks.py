"""Ranks of a distributed job: each captured process's rank identity, and the other ranks of the job a
capture was pointed at (one rank's hang is read in the state of the whole group, never of one rank).

Read-only: /proc/PID/environ (only the rendezvous variables are kept), /proc/PID/stat and cmdline.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from kvdiag.capture.discover import _title
from kvdiag.model.ranks import RankIdentity
from kvdiag.osread.process import read_environ
from kvdiag.osread.stat import all_stats, read_stat

# How many processes one job may add to a capture: more ranks than one host runs.
MAX_JOB_RANKS = 64

_INTS = {"RANK": "rank", "LOCAL_RANK": "local_rank", "WORLD_SIZE": "world_size",
         "LOCAL_WORLD_SIZE": "local_world_size", "GROUP_RANK": "group_rank", "MASTER_PORT": "master_port"}
_TEXTS = {"MASTER_ADDR": "master_addr", "TORCHELASTIC_RUN_ID": "run_id"}


def rank_from_environ(environ: Mapping[str, str]) -> RankIdentity | None:
    """The rank variables of ``environ`` (None: it sets no rank and no rendezvous)."""
    fields: dict[str, object] = {}
    for var, name in _INTS.items():
        value = environ.get(var, "").strip()
        if value.lstrip("-").isdigit():
            fields[name] = int(value)
    for var, name in _TEXTS.items():
        value = environ.get(var, "").strip()
        if value:
            fields[name] = value[:200]
    if "rank" not in fields and "master_addr" not in fields and "run_id" not in fields:
        return None
    return RankIdentity.model_validate(fields)


def read_rank(pid: int) -> RankIdentity | None:
    """``pid``'s rank identity, from the environment it was started with (None: none, or unreadable)."""
    environ = read_environ(pid)
    return rank_from_environ(environ) if environ is not None else None


def _vllm_worker(pid: int) -> bool:
    """A process vLLM titled as one of its workers (``VLLM::Worker_TP1``; comm keeps 15 characters)."""
    cmdline, comm = _title(pid)
    return cmdline.startswith("VLLM::Worker") or comm.startswith("VLLM::Worker")


def is_rank(pid: int) -> bool:
    """Whether ``pid`` is a rank of a distributed job: a rank in its environment, or a vLLM worker's title."""
    return read_rank(pid) is not None or _vllm_worker(pid)


def job_ranks(pids: Iterable[int], *, me: int | None = None) -> list[int]:
    """The processes on this host that are ranks of the same job as one of ``pids`` but not among them:
    the same rendezvous (master address and port, world size, or elastic run id) in their environment, or
    vLLM's workers beside a vLLM worker (the same parent). Only processes of the same owner are readable."""
    me = os.getpid() if me is None else me
    given = list(pids)
    keys = {key for pid in given if (ident := read_rank(pid)) is not None and (key := ident.job_key())}
    parents = {st.ppid for pid in given if _vllm_worker(pid) and (st := read_stat(pid)) is not None}
    if not keys and not parents:
        return []
    out: list[int] = []
    for st in all_stats():
        if st.pid in given or st.pid == me or st.state in ("Z", "X") or len(out) >= MAX_JOB_RANKS:
            continue
        if st.ppid in parents and _vllm_worker(st.pid):
            out.append(st.pid)
            continue
        if keys:
            ident = read_rank(st.pid)
            if ident is not None and ident.job_key() in keys:
                out.append(st.pid)
    return out


__all__ = ["MAX_JOB_RANKS", "is_rank", "job_ranks", "rank_from_environ", "read_rank"]
