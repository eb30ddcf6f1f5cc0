"""The one view every renderer reads: the report (verdicts, health lines, banner risks, saturation, all as
the diagnosis stored them) and the captured stacks with the frames the evidence cites.

Built once per rendering from a bundle and its stored diagnosis. A cited frame is found by its reference
(:class:`~kvdiag.model.waits.FrameRef`: pid, tid, frame index), never by its text; evidence written before
references were kept is shown as it was, with no frame of the stacks highlighted. Nothing here judges.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import Frame, ProcessEvidence, ThreadEvidence
from kvdiag.model.kinds import EnginePhase, ProcessRole
from kvdiag.model.report import Report
from kvdiag.model.verdict import EvidenceItem, ThreadWait
from kvdiag.report.chain import ChainView, chain_view
from kvdiag.report.soakview import SoakView, soak_view, watch_view

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


MAX_WAIT_ROWS = 40
_WAIT_WORDS = {"new_work": "new work", "outcome": "an outcome", "running": "(running)", "other": "other"}


def wait_word(w: ThreadWait) -> str:
    """How the reports name a thread's wait purpose ("an outcome, stuck" when it did not advance)."""
    word = _WAIT_WORDS.get(w.purpose.value, w.purpose.value)
    return f"{word}, stuck" if w.stuck else word


def clean_text(text: str) -> str:
    """Strip ANSI colour codes and control characters a browser or terminal would mangle."""
    return _CONTROL.sub("\ufffd", _ANSI.sub("", text))


def format_frame(frame: Frame) -> str:
    """``name (file:line)`` for Python frames, ``name (file:line) [library]`` for native ones."""
    where = ""
    if frame.file:
        where = f" ({frame.file}:{frame.line})" if frame.line is not None else f" ({frame.file})"
    lib = f" [{frame.library}]" if frame.library and frame.kind == "native" else ""
    return f"{frame.name}{where}{lib}"


# ---------------------------------------------------------------- captured stacks

@dataclass(frozen=True)
class FrameLine:
    """One frame of a thread's stack as shown: ``key`` when the verdict rests on it, ``cited`` when an
    evidence item shows it."""

    text: str
    kind: str
    source: str
    key: bool = False
    cited: bool = False


@dataclass(frozen=True)
class ThreadLines:
    """One thread of a captured process as shown: its /proc and GIL readings as text, its frames (innermost
    first, marked), the other tools' stacks of it, and the roles the evidence cites it in."""

    tid: int
    name: str
    state: str
    wchan: str | None
    gil: str
    in_gil_struct: bool | None
    syscall: str | None
    cpu_ticks_delta: int | None
    kernel_stack: list[str]
    frames: list[FrameLine]
    by_tool: list[tuple[str, list[str]]]
    roles: list[str]                 # the roles the evidence cites this thread in

    @property
    def cited(self) -> bool:
        return bool(self.roles)

    @property
    def has_key_frames(self) -> bool:
        return any(f.key for f in self.frames)


@dataclass(frozen=True)
class ProcessLines:
    pid: int
    ppid: int | None
    node: str | None
    role: str
    engine: str | None
    comm: str | None
    cmdline: str
    state: str
    wchan: str | None
    cpu_percent: float | None
    alive: bool
    python_version: str | None
    exe: str | None
    tools: list[dict[str, Any]]
    threads: list[ThreadLines]

    @property
    def cited(self) -> bool:
        return any(t.cited for t in self.threads)


_ROLE_ORDER = {ProcessRole.ENGINE_CORE: 0, ProcessRole.WORKER: 1, ProcessRole.API_SERVER: 2, ProcessRole.OTHER: 3}


def _same_node(a: str | None, b: str | None) -> bool:
    """A reference without a node names a thread of a single-host bundle (or of the only node)."""
    return a is None or b is None or a == b


def _items_of(evidence: list[EvidenceItem], proc: ProcessEvidence, th: ThreadEvidence) -> list[EvidenceItem]:
    return [i for i in evidence if i.pid == proc.pid and i.tid == th.tid and _same_node(i.node, proc.node)]


def _indices(items: list[EvidenceItem], proc: ProcessEvidence, th: ThreadEvidence,
             key: bool) -> set[int]:
    """Frame indices into ``th.frames`` the items reference (only their key frames when ``key``)."""
    out: set[int] = set()
    for item in items:
        refs = item.key_refs() if key else item.refs
        out.update(r.index for r in refs if r.tool is None and r.pid == proc.pid and r.tid == th.tid
                   and _same_node(r.node, proc.node) and 0 <= r.index < len(th.frames))
    return out


def thread_lines(proc: ProcessEvidence, th: ThreadEvidence, evidence: list[EvidenceItem]) -> ThreadLines:
    items = _items_of(evidence, proc, th)
    keys, cited = _indices(items, proc, th, key=True), _indices(items, proc, th, key=False)
    return ThreadLines(
        tid=th.tid, name=clean_text(th.name or ""), state=th.state.value, wchan=th.wchan, gil=th.gil.value,
        in_gil_struct=th.in_gil_struct, syscall=th.syscall, cpu_ticks_delta=th.cpu_ticks_delta,
        kernel_stack=[clean_text(k) for k in th.kernel_stack],
        frames=[FrameLine(text=clean_text(format_frame(f)), kind=f.kind, source=clean_text(f.source or ""),
                          key=i in keys, cited=i in cited) for i, f in enumerate(th.frames)],
        by_tool=[(tool, [clean_text(format_frame(f)) for f in fs]) for tool, fs in th.frames_by_tool.items()],
        roles=[item.role for item in items],
    )


def process_lines(bundle: Bundle | None, evidence: list[EvidenceItem]) -> list[ProcessLines]:
    """Every captured process with its threads, in the bundle's order."""
    if bundle is None:
        return []
    return [ProcessLines(
        pid=proc.pid, ppid=proc.ppid, node=proc.node, role=proc.role.value, engine=proc.engine,
        comm=proc.comm, cmdline=clean_text(shlex.join(proc.cmdline)) if proc.cmdline else "",
        state=proc.state.value, wchan=proc.wchan, cpu_percent=proc.cpu_percent, alive=proc.alive,
        python_version=proc.python_version, exe=proc.exe,
        tools=[{**t.model_dump(mode="json"), "state": t.state} for t in proc.tools],
        threads=[thread_lines(proc, th, evidence) for th in proc.threads]) for proc in bundle.processes]


def cited_first(processes: list[ProcessLines]) -> list[ProcessLines]:
    """Cited processes first (then by role: EngineCore, worker, API server), each with its cited threads
    first; otherwise the capture order."""
    out = [replace(p, threads=sorted(p.threads, key=lambda t: not t.cited)) for p in processes]
    out.sort(key=lambda p: (not p.cited, _ROLE_ORDER.get(ProcessRole(p.role), 9)))
    return out


# ---------------------------------------------------------------- evidence

@dataclass(frozen=True)
class EvidenceLines:
    """One evidence item as shown: each cited line with its mark (``key``, ``ctx``, or None for a report
    written before key frames were kept)."""

    item: EvidenceItem
    lines: list[tuple[str, str | None]]


def evidence_lines(item: EvidenceItem) -> EvidenceLines:
    if item.key_frames is None:
        return EvidenceLines(item, [(f, None) for f in item.frames])
    return EvidenceLines(item, [(f, "key" if item.is_key(n) else "ctx") for n, f in enumerate(item.frames)])


# ---------------------------------------------------------------- A/B

_SIDE_BUNDLE = re.compile(r"^(?:\.\./)?[A-Za-z0-9_.-]+/bundle/?$")


def page_href(path: str | None, base: str) -> str | None:
    """A link to ``path`` (relative to the A/B output folder ``base``, as seen from the page)."""
    if not path or path.startswith(("/", "\\")) or ":" in path.split("/", 1)[0]:
        return None
    if ".." in PurePosixPath(path).parts:
        return None
    return quote(posixpath.normpath(posixpath.join(base, path)) if base else path, safe="/")


def ab_view(report: Report) -> dict[str, Any] | None:
    """Both runs of ``kvdiag ab`` side by side, from the stored comparison (``report.ab``).

    Each side's verdict, summary, exit code, engines and report/bundle paths; per-engine verdicts
    come from ``verdicts_by_engine`` keyed "side/engine", else from the side's verdict when that
    names the engine.
    """
    ab = report.ab
    if ab is None:
        return None
    # The A/B output folder as seen from the page: the folder holding the A/B bundle.
    base = posixpath.dirname((report.bundle_path or "bundle").replace("\\", "/").rstrip("/"))
    sides: list[dict[str, Any]] = []
    for label, side in (("stock", ab.stock), ("fixed", ab.fixed)):
        side_verdict = report.verdicts_by_engine.get(label)
        engines: list[dict[str, Any]] = []
        for name, info in side.engines.items():
            own = report.verdicts_by_engine.get(f"{label}/{name}")
            if own is not None:
                kind: str | None = own.kind.value
            elif side_verdict is not None and side_verdict.engine == name:
                kind = side_verdict.kind.value
            elif side_verdict is not None and side_verdict.kind.value == "healthy":
                kind = "healthy"  # a healthy run: every engine in it is
            else:
                kind = None
            engines.append({"name": name, "phase": info.phase.value, "healthy": info.healthy,
                            "startup_s": info.startup_s, "verdict": kind})
        report_rel = side.report or f"{label}/report.html"
        if _SIDE_BUNDLE.match(side.bundle):
            # stored relative to the A/B bundle folder ("../stock/bundle")
            bundle_rel = posixpath.normpath(posixpath.join("bundle", side.bundle))
        else:
            bundle_rel = posixpath.join(posixpath.dirname(report_rel), "bundle")
        sides.append({
            "label": label, "verdict": side.verdict.value, "summary": side.summary, "exit_code": side.exit_code,
            "report": report_rel, "report_href": page_href(report_rel, base),
            "bundle": bundle_rel, "bundle_href": page_href(bundle_rel + "/bundle.json", base),
            "engines": engines,
        })
    return {"separated": ab.separated, "sides": sides, "base": base,
            "title": ab.title}


# ---------------------------------------------------------------- the view

_ENGINE_COMMANDS = frozenset({"repro", "ab", "soak", "sweep", "watch"})


@dataclass
class ReportView:
    """What every renderer reads: the report and the bundle's stacks, cited frames marked by reference.

    Every renderer of a run's report takes the view and nothing else (``render_json``, ``render_markdown``,
    ``render_html``: ``(view) -> str``; ``render_terminal`` prints it on a console)."""

    report: Report
    bundle: Bundle | None = None
    bundle_dir: Path | None = None   # where the page finds the raw tool outputs and logs (None: nowhere)
    processes: list[ProcessLines] = field(default_factory=list)   # cited first (see cited_first)
    cited: list[tuple[ProcessLines, ThreadLines]] = field(default_factory=list)   # in capture order
    evidence: list[EvidenceLines] = field(default_factory=list)
    ab: dict[str, Any] | None = None
    chain: ChainView | None = None   # the verdict's cross-process wait chain, as rows
    soak: SoakView | None = None     # a soak's figures and plots (kvdiag.report.soakview)

    @property
    def has_key_frames(self) -> bool:
        return any(item.key_frames for item in self.report.verdict.evidence)

    @property
    def engine_run(self) -> bool:
        """The report is of an LLM engine (launched, soaked, watched, or a captured vLLM tree), so its
        allocator, start-up phase and PageAllocator banners mean something; a plain process captured
        with `kvdiag capture --pid` has none of them, and showing "external", "not_started" and an empty
        banner section for it is noise."""
        r = self.report
        if r.command.split(" ", 1)[0] in _ENGINE_COMMANDS:
            return True
        return any(e.banners or e.phase is not EnginePhase.NOT_STARTED or e.pids.engine_core is not None
                   or e.pids.api_server is not None or e.allocator not in (None, "external") for e in r.engines)


def build_view(report: Report, bundle: Bundle | None = None, bundle_dir: Path | None = None) -> ReportView:
    """The view of ``report`` and the (redacted) ``bundle`` it was built from (``bundle_dir``: its folder)."""
    evidence = report.verdict.evidence
    processes = process_lines(bundle, evidence)
    return ReportView(report=report, bundle=bundle, bundle_dir=bundle_dir, processes=cited_first(processes),
                      cited=[(p, t) for p in processes for t in p.threads if t.cited],
                      evidence=[evidence_lines(item) for item in evidence], ab=ab_view(report),
                      chain=chain_view(report.verdict),
                      soak=soak_view(report, bundle) or watch_view(report, bundle))


__all__ = ["EvidenceLines", "FrameLine", "ProcessLines", "ReportView", "ThreadLines", "ab_view",
           "build_view", "cited_first", "clean_text", "evidence_lines", "format_frame", "page_href"]
