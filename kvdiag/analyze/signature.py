"""A stable hang signature: the verdict kind and the project frames it cites, hashed.

The same hang gives the same signature on every run and host: pids, tids,
addresses, file paths and line numbers are left out; C++ names keep their
last two scopes (``PageAllocator::alloc_page``) without templates or
parameters; libc, the interpreter, binding glue, wait primitives and the
standard library are not project frames. Per cited thread the native
project frames are used when there are any (they are what every capture
tool sees), else its Python project frames; at most :data:`FRAMES_PER_THREAD`,
innermost first. Threads are sorted, so the order of the evidence does not
matter; of a chain across processes only the root's threads count, so the
signature does not depend on how many waiters the capture reached. Pure: no I/O.

Format: ``<kind>-<12 hex digits>``, e.g. ``gil_cycle-5d0c2b8e41a7``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence

from kvdiag.analyze import vocab as v
from kvdiag.analyze.known import match_known
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import Frame
from kvdiag.model.verdict import EvidenceItem, Verdict

FRAMES_PER_THREAD = 4
SCHEME = "kvdiag-signature-1"
_DESCRIBED = re.compile(r"^(?P<name>.*?) \((?P<where>[^()]*)\)$")


def _drop_nested(text: str, open_ch: str, close_ch: str) -> str:
    out: list[str] = []
    depth = 0
    for ch in text:
        if ch == open_ch:
            depth += 1
        elif ch == close_ch and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def canonical_name(name: str) -> str:
    """``kvcached::PageAllocator::map_pages(std::vector<long> const&)`` → ``PageAllocator::map_pages``."""
    n = name.strip()
    if n.startswith("<") and n.endswith(">"):  # Python's <module>, <lambda>, <listcomp>
        return n
    n = re.sub(r"\s*\[clone [^\]]*\]", "", n)
    n = re.sub(r"\s*\(inlined\)$", "", n)
    n = re.sub(r"@@?[A-Z_]+[\d.]*$", "", n)
    n = n.replace("operator()", "operator_call")
    n = _drop_nested(n, "<", ">")
    n = _drop_nested(n, "(", ")")
    n = re.sub(r"\s+const$", "", n).strip()
    n = re.sub(r"\.(?:constprop|isra|part|cold)\.\d+$", "", n)
    parts = [p for p in n.split("::") if p]
    return "::".join(parts[-2:]) if parts else n


def _frame_from_text(text: str) -> Frame:
    """Back from an evidence line (``alloc_page (gil_cycle.c:66)``) to a frame, as far as it tells."""
    m = _DESCRIBED.match(text)
    if m is None:
        return Frame(name=text)
    name, where = m.group("name"), m.group("where")
    fm = re.match(r"^(?P<file>.+):(?P<line>\d+)$", where)
    if fm:
        file = fm.group("file")
        return Frame(name=name, kind="python" if file.endswith(".py") else "native", file=file)
    return Frame(name=name, library=where)


def project_frames(frames: Iterable[Frame]) -> list[str]:
    """The canonical names of a thread's project frames, innermost first (native ones when any)."""
    native: list[str] = []
    python: list[str] = []
    for f in frames:
        if v.is_project_frame(f):
            (python if f.kind == "python" else native).append(canonical_name(f.name))
    chosen = native or python
    out: list[str] = []
    for name in chosen:
        if name and (not out or out[-1] != name):
            out.append(name)
    return out[:FRAMES_PER_THREAD]


_TOOL_ORDER = ("pystack", "py-spy", "gdb")


def _thread_stacks(item: EvidenceItem, bundle: Bundle | None) -> list[list[Frame]]:
    """Where to read the thread's project frames, in order: the cited frames, the thread's merged
    stack, then each tool's own stack (pystack, py-spy, gdb). Without the bundle's thread, only the
    evidence lines parsed back."""
    cited = list(item.frames)
    if bundle is not None:
        for p in bundle.processes:
            if p.pid != item.pid or (item.node is not None and p.node != item.node):
                continue
            for t in p.threads:
                if t.tid != item.tid:
                    continue
                wanted = set(cited)
                picked = [f for f in t.frames if v.describe(f) in wanted]
                tools = sorted(t.frames_by_tool, key=lambda n: (_TOOL_ORDER.index(n) if n in _TOOL_ORDER
                                                                 else len(_TOOL_ORDER), n))
                return [picked or [_frame_from_text(x) for x in cited], list(t.frames)] + [
                    list(t.frames_by_tool[n]) for n in tools]
    return [[_frame_from_text(x) for x in cited]]


def _thread_group(item: EvidenceItem, bundle: Bundle | None) -> tuple[str, ...]:
    # The citation stops after a dozen frames, and the merged stack may hold one tool's frames only:
    # without pystack the interpreter's own frames can fill both before the first project frame, so
    # the next place is read until one names a project frame.
    for frames in _thread_stacks(item, bundle):
        group = project_frames(frames)
        if group:
            return tuple(group)
    return ()


def _root_evidence(verdict: Verdict) -> list[EvidenceItem]:
    """The cited threads the hang itself is made of: for a chain across processes, those of the root's
    process (the waiters in front of it depend on what was captured: one actor or the whole cluster),
    else every cited thread."""
    chain = verdict.waits
    root = chain.root if chain is not None and not chain.cycle else None
    if root is None:
        return list(verdict.evidence)
    mine = [e for e in verdict.evidence if e.pid == root.pid and (root.node is None or e.node in (None, root.node))]
    if mine or chain is None or not chain.root_frames:
        return mine or list(verdict.evidence)
    # the root is not among the cited threads: the chain carries its frames
    return [EvidenceItem(pid=root.pid, tid=root.tid or root.pid, role=chain.root_role, frames=chain.root_frames,
                         node=root.node)]


def signature_groups(verdict: Verdict, bundle: Bundle | None = None) -> list[tuple[str, ...]]:
    """Per cited thread of the hang's root, its project frames; empty threads dropped, duplicates merged,
    sorted."""
    groups = {_thread_group(item, bundle) for item in _root_evidence(verdict)}
    return sorted(g for g in groups if g)


def signature_from_groups(kind: str, groups: Sequence[Sequence[str]]) -> str:
    canon = "\n".join([SCHEME, kind] + [" > ".join(g) for g in sorted(tuple(g) for g in groups)])
    return f"{kind}-{hashlib.sha256(canon.encode('utf-8')).hexdigest()[:12]}"


def hang_signature(verdict: Verdict, bundle: Bundle | None = None) -> str | None:
    """The signature of a hang verdict; None for a verdict that is not a hang."""
    if not verdict.kind.is_hang:
        return None
    return signature_from_groups(verdict.kind.value, signature_groups(verdict, bundle))


def sign(verdict: Verdict, bundle: Bundle | None = None) -> Verdict:
    """Set ``verdict.signature`` and ``verdict.known`` (in place; returned for chaining)."""
    verdict.signature = hang_signature(verdict, bundle)
    verdict.known = match_known(verdict, signature_groups(verdict, bundle)) if verdict.signature else None
    return verdict
