"""Merge what each backend saw of one process into one ThreadEvidence per task.

/proc owns the kernel-side fields (state, wchan, syscall, futex, CPU); the
stack tools contribute frames (kept per tool in ``frames_by_tool``; the
richest becomes ``frames``) and GIL readings (kept per tool in
``gil_by_tool``; pystack's interpreter flag wins, then /proc's futex/GIL-struct
inference, then py-spy's ``+gil`` marker).
"""

from __future__ import annotations

from kvdiag.capture.base import BackendResult
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import Frame, ProcessEvidence, ThreadEvidence
from kvdiag.model.kinds import GilState
from kvdiag.model.run import Finding

# Which tool's GIL reading to trust first.
_GIL_PRECEDENCE = ("pystack", "agent", "proc", "py-spy", "gdb")
# Tie-break between equally rich stacks: pystack interleaves Python and native frames.
_FRAME_PREFERENCE = {"pystack": 3, "agent": 3, "gdb": 2, "py-spy": 1}


def stack_richness(tool: str, frames: list[Frame]) -> tuple[int, int, int]:
    """Sort key: stacks with both Python and native frames first, then named frames, then tool."""
    named = sum(1 for f in frames if f.name not in ("???", "??", "") and not f.name.startswith("0x"))
    mixed = int(any(f.kind == "python" for f in frames) and any(f.kind == "native" for f in frames))
    return mixed, named, _FRAME_PREFERENCE.get(tool, 0)


def merge_threads(results: dict[str, BackendResult]) -> list[ThreadEvidence]:
    """One ThreadEvidence per TID seen by any backend, sorted by TID."""
    merged: dict[int, ThreadEvidence] = {}
    proc = results.get("proc")
    if proc is not None:
        for t in proc.threads:
            merged[t.tid] = t.model_copy(deep=True)
            merged[t.tid].frames = []
            if t.gil is not GilState.UNKNOWN:
                merged[t.tid].gil_by_tool["proc"] = t.gil
    for tool, res in results.items():
        if tool == "proc":
            continue
        for t in res.threads:
            into = merged.setdefault(t.tid, ThreadEvidence(tid=t.tid))
            if t.frames:
                into.frames_by_tool[tool] = list(t.frames)
            if t.gil is not GilState.UNKNOWN:
                into.gil_by_tool[tool] = t.gil
            if t.name and (tool == "py-spy" or not into.name):
                into.name = t.name   # py-spy has the Python thread name ("MainThread", "ticker")
    for t in merged.values():
        t.gil = next((t.gil_by_tool[k] for k in _GIL_PRECEDENCE if k in t.gil_by_tool), GilState.UNKNOWN)
        if t.frames_by_tool:
            best = max(t.frames_by_tool.items(), key=lambda kv: stack_richness(kv[0], kv[1]))
            t.frames = list(best[1])
    return [merged[tid] for tid in sorted(merged)]


def _settle(t: ThreadEvidence) -> None:
    t.gil = next((t.gil_by_tool[k] for k in _GIL_PRECEDENCE if k in t.gil_by_tool), GilState.UNKNOWN)
    t.frames = list(max(t.frames_by_tool.items(), key=lambda kv: stack_richness(kv[0], kv[1]))[1]) \
        if t.frames_by_tool else []


def add_tools(first: ProcessEvidence, later: ProcessEvidence) -> ProcessEvidence:
    """``first`` (one process's evidence) with what a later capture of it by other tools saw added:
    their stacks and GIL readings per thread, their tool runs (replacing any of ``first``'s of the same
    name), the preflight as the later capture found it. /proc's fields stay ``first``'s."""
    out = first.model_copy(deep=True)
    names = {r.tool for r in later.tools}
    out.tools = [r for r in out.tools if r.tool not in names] + [r.model_copy() for r in later.tools]
    out.alive = first.alive and later.alive
    out.python_version = first.python_version or later.python_version
    out.access = later.access.model_copy() if later.access is not None else out.access
    threads = {t.tid: t for t in out.threads}
    for t in later.threads:
        into = threads.get(t.tid)
        if into is None:
            into = threads[t.tid] = ThreadEvidence(tid=t.tid)
            out.threads.append(into)
        for tool in names:
            into.frames_by_tool.pop(tool, None)
            into.gil_by_tool.pop(tool, None)
        into.frames_by_tool.update({k: list(v) for k, v in t.frames_by_tool.items()})
        into.gil_by_tool.update(t.gil_by_tool)
        if t.name and not into.name:
            into.name = t.name
    for t in out.threads:
        _settle(t)
    out.threads.sort(key=lambda t: t.tid)
    return out


def without_tool(proc: ProcessEvidence, tool: str) -> ProcessEvidence:
    """``proc`` as a capture without ``tool`` would have merged it (for "what if it were missing").

    Valid because the backends do not feed each other: each reads the target on its own, the
    ptrace tools one after another. Dropping "proc" keeps only what the stack tools saw, plus what
    capture reads whatever backends run: the preflight (``access``: may it be read, its state and
    tracer as found) and the role/engine the caller assigned. Everything the /proc backend derived
    goes: thread states, CPU and context switches, wchan, syscalls and futex owners, fds and their
    peers, the sample window, the log files on fd 1/2, signal masks, the GIL read from memory.
    """
    out = proc.model_copy(deep=True)
    out.tools = [r for r in out.tools if r.tool != tool]
    if tool == "proc":
        out = ProcessEvidence(pid=proc.pid, role=proc.role, engine=proc.engine, alive=proc.alive,
                              python_version=proc.python_version, tools=out.tools,
                              access=proc.access.model_copy() if proc.access is not None else None)
        for t in proc.threads:
            if not t.frames_by_tool:
                continue
            out.threads.append(ThreadEvidence(tid=t.tid, name=t.name, frames_by_tool=dict(t.frames_by_tool),
                                              gil_by_tool={k: g for k, g in t.gil_by_tool.items() if k != "proc"}))
    else:
        for t in out.threads:
            t.frames_by_tool.pop(tool, None)
            t.gil_by_tool.pop(tool, None)
    for t in out.threads:
        _settle(t)
    return out


# Findings only the /proc backend writes (kvdiag.capture.procfs).
_PROC_FINDINGS = frozenset({"target_stopped", "target_uninterruptible"})


def bundle_without_tool(bundle: Bundle, tool: str) -> Bundle:
    """``bundle`` as a capture without ``tool`` would have written it: every process through
    :func:`without_tool`, and the findings that tool alone writes (its failures, /proc's state notes) dropped."""
    def kept(f: Finding) -> bool:
        if tool == "proc" and f.kind in _PROC_FINDINGS:
            return False
        return not (f.kind in ("tool_failed", "tool_timeout", "tool_missing") and f.message.startswith(
            (f"pid {f.pid}: {tool} ", f"{tool} ")))
    return bundle.model_copy(update={"processes": [without_tool(p, tool) for p in bundle.processes],
                                     "findings": [f for f in bundle.findings if kept(f)]})
