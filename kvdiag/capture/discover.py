"""Find the processes of one engine: API server, EngineCore, workers.

vLLM (V1) runs the API server (``vllm serve``; comm ``vllm`` or ``python``)
with multiprocessing *spawn* children titled ``VLLM::EngineCore`` (comm cut to
``VLLM::EngineCor``) and ``VLLM::Worker``; with data/tensor parallelism the
titles get suffixes (``EngineCore_DP0``, ``Worker_TP1``). The EngineCore pid
also appears in its own log prefix ``(EngineCore pid=N)``. The EngineCore
owns the KV allocator and is the process to capture; the API server never is.
"""

from __future__ import annotations

import re

from kvdiag.model.kinds import ProcessRole
from kvdiag.osread.process import read_cmdline, read_comm
from kvdiag.osread.ptable import ancestors, process_tree

_ENGINE_RE = re.compile(r"(^|[^A-Za-z])EngineCore", re.IGNORECASE)
_WORKER_RE = re.compile(r"^VLLM::(Worker|VllmWorker)|(^|[^A-Za-z])VllmWorker|::Worker(_|$)")
_API_MARKERS = ("vllm serve", "entrypoints.openai.api_server", "entrypoints/openai/api_server",
                "api_server", "apiserver")
_HELPER_MARKERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
                   "multiprocessing.semaphore_tracker")

_LOG_KEYS: dict[str, ProcessRole] = {
    "engine_core": ProcessRole.ENGINE_CORE, "enginecore": ProcessRole.ENGINE_CORE,
    "api_server": ProcessRole.API_SERVER, "apiserver": ProcessRole.API_SERVER,
    "worker": ProcessRole.WORKER, "vllmworker": ProcessRole.WORKER,
}


def _log_role(key: str) -> ProcessRole | None:
    norm = re.sub(r"[^a-z_]", "", key.lower().split("-")[0].split("_dp")[0].split("_tp")[0])
    return _LOG_KEYS.get(norm) or _LOG_KEYS.get(norm.replace("_", ""))


_LOG_PREFIX = re.compile(r"\((\w[\w-]*) pid=(\d+)\)")


def log_prefix_pids(lines: list[str]) -> dict[str, int]:
    """``(EngineCore pid=6898)``, ``(APIServer pid=6790)``, ``(Worker pid=6946)`` → role key → pid.

    Keys are normalised to ``engine_core`` / ``api_server`` / ``worker`` (the first pid seen wins;
    data-parallel suffixes like ``EngineCore_DP1`` keep their own key).
    """
    out: dict[str, int] = {}
    for line in lines:
        for name, pid in _LOG_PREFIX.findall(line):
            role = _log_role(name)
            plain = name in ("EngineCore", "APIServer", "Worker") or name.startswith("VllmWorker")
            key = role.value if role is not None and plain else name
            out.setdefault(key, int(pid))
    return out


def _title(pid: int) -> tuple[str, str]:
    """(cmdline joined by spaces, comm); empty strings when unreadable."""
    return " ".join(read_cmdline(pid) or []), read_comm(pid) or ""


def classify_title(cmdline: str, comm: str) -> ProcessRole:
    """Role from a process's title alone (OTHER when it says nothing).

    Only the title itself (first argument, or comm) can make an EngineCore: an API server whose
    arguments mention "EngineCore" must never be taken for one.
    """
    first = cmdline.split(" ", 1)[0] if cmdline else ""
    if comm.startswith("VLLM::EngineCor") or _ENGINE_RE.search(first) or first.startswith("VLLM::EngineCore"):
        return ProcessRole.ENGINE_CORE
    if comm.startswith("VLLM::Worker") or _WORKER_RE.search(first):
        return ProcessRole.WORKER
    low = cmdline.lower()
    if any(m in low for m in _HELPER_MARKERS):
        return ProcessRole.OTHER
    if any(m in low for m in _API_MARKERS) or comm in ("vllm",):
        return ProcessRole.API_SERVER
    return ProcessRole.OTHER


def multiprocessing_helper(pid: int) -> bool:
    """A helper that Python's multiprocessing starts beside an engine (its resource tracker, forkserver):
    it serves the engine's processes at their start and exit only, and its threads read as idle by design
    whatever their stacks say, so a pausing stack tool learns nothing there that /proc does not."""
    low = " ".join(read_cmdline(pid) or []).lower()
    return any(m in low for m in _HELPER_MARKERS)


def _ancestors(pid: int, root_pid: int) -> list[int]:
    """Parents of ``pid`` up to and including ``root_pid`` (empty when unreadable)."""
    chain = ancestors(pid)
    return chain[:chain.index(root_pid) + 1] if root_pid in chain else chain


def find_engine_processes(root_pid: int, log_pids: dict[str, int] | None = None) -> dict[ProcessRole, list[int]]:
    """Roles of ``root_pid`` and its descendants.

    Sources, strongest first: the process title (``VLLM::EngineCore``), the pids the
    log announced (``log_pids``, keys like "engine_core" / "EngineCore" / "api_server"),
    then the tree shape: the root that spawned an EngineCore is the API server. A
    process that looks like an API server is never returned as the engine core.
    """
    tree = process_tree(root_pid)
    roles: dict[int, ProcessRole] = {}
    titles: dict[int, tuple[str, str]] = {pid: _title(pid) for pid in tree}
    for pid in tree:
        roles[pid] = classify_title(*titles[pid])
    titled_engines = {pid for pid, r in roles.items() if r is ProcessRole.ENGINE_CORE}
    spawned_engine = {anc for pid in titled_engines for anc in _ancestors(pid, root_pid)}
    for key, pid in (log_pids or {}).items():
        role = _log_role(key)
        if role is None or pid not in roles:
            continue
        if role is ProcessRole.ENGINE_CORE:
            # A log line cannot make the API server (or any parent of a titled EngineCore) the engine core.
            if classify_title(*titles[pid]) is not ProcessRole.API_SERVER and pid not in spawned_engine:
                roles[pid] = role
        elif roles[pid] is ProcessRole.OTHER:
            roles[pid] = role
    has_engine = any(r is ProcessRole.ENGINE_CORE for r in roles.values())
    if tree and has_engine and roles[root_pid] is ProcessRole.OTHER:
        # vLLM's shape: the process that spawned the EngineCore serves the API.
        low = titles[root_pid][0].lower()
        if not any(m in low for m in _HELPER_MARKERS):
            roles[root_pid] = ProcessRole.API_SERVER
    out: dict[ProcessRole, list[int]] = {}
    for pid in tree:
        out.setdefault(roles[pid], []).append(pid)
    return out
