"""What analyze concluded: verdicts with their evidence, the A/B comparison, the diagnosis."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field

from kvdiag.model.judged import EngineJudgement
from kvdiag.model.kinds import Confidence, EnginePhase, VerdictKind, _Model
from kvdiag.model.run import Finding
from kvdiag.model.waits import FrameRef, WaitChain, WaitGraphRecord


class KnownDefect(_Model):
    """A verdict matched to a known upstream defect."""

    id: str                          # "kvcached#371"
    title: str
    fixed_by: str | None = None      # "PR #422 (666671b)"
    fixed_in: str | None = None      # first release with the fix: "0.1.6"
    workaround: str | None = None
    url: str | None = None
    match: Literal["signature", "pattern"] = "pattern"

    def text(self) -> str:
        """``kvcached#371 (...); fixed by PR #422, first in 0.1.6``."""
        text = f"{self.id} ({self.title})"
        if self.fixed_by:
            text += f"; fixed by {self.fixed_by}"
        if self.fixed_in:
            text += f", first in {self.fixed_in}"
        return text

    def line(self) -> str:
        """``known: kvcached#371 (...); fixed by PR #422, first in 0.1.6``."""
        return f"known: {self.text()}"

class EvidenceItem(_Model):
    pid: int
    tid: int
    role: str                        # "alloc_page caller (holds GIL)", "prealloc worker (waits for GIL)"
    frames: list[str] = Field(default_factory=list)
    engine: str | None = None
    node: str | None = None          # the host ``pid`` lives on, in a bundle merged from several hosts
    # Indices into ``frames`` of the frames the rule's conclusion rests on (the wait primitive, the
    # first project frame, ...), decided by the analyzer; renderers highlight only these. None: not
    # recorded (nothing is highlighted).
    key_frames: list[int] | None = None
    # ``refs[n]`` is the captured frame ``frames[n]`` displays, so ``key_frames`` index both; renderers
    # find a cited frame in the bundle by this reference, never by its text. Empty: a report written
    # before references were kept (its frames are shown, none highlighted in the stacks).
    refs: list[FrameRef] = Field(default_factory=list)

    def is_key(self, index: int) -> bool:
        return self.key_frames is not None and index in self.key_frames

    def key_refs(self) -> list[FrameRef]:
        """The captured frames the rule's conclusion rests on (none without references)."""
        if len(self.refs) != len(self.frames):
            return []
        return [self.refs[i] for i in self.key_frames or [] if 0 <= i < len(self.refs)]


class Verdict(_Model):
    kind: VerdictKind
    summary: str
    confidence: Confidence = Confidence.MEDIUM
    evidence: list[EvidenceItem] = Field(default_factory=list)
    engine: str | None = None
    cycle: list[str] = Field(default_factory=list)   # node labels of the wait-for cycle, in order
    findings: list[Finding] = Field(default_factory=list)
    # A stable hash of the kind and the cited project frames (kvdiag.analyze.signature), and the
    # known upstream defect it matches.
    signature: str | None = None
    known: KnownDefect | None = None
    # What raised or lowered ``confidence`` ("+ /health answered", "- no stacks were captured"):
    # evidence only, never timing noise (a verdict must not change with the machine's load).
    confidence_reasons: list[str] = Field(default_factory=list)
    # The cross-process wait chain the verdict followed, first waiter to root (kvdiag.analyze.xproc);
    # None: judged inside one process.
    waits: WaitChain | None = None


class ABEngine(_Model):
    """One engine of one A/B side (``ab.<side>.engines[name]`` in bundle.json and report.json)."""

    phase: EnginePhase = EnginePhase.NOT_STARTED
    healthy: bool = False            # its verdict is healthy (kvdiag.model.health)
    health: str = ""                 # the health line: "yes", "no (decode stall; /health still answered)"
    startup_s: float | None = None


class ABSide(_Model):
    """One side of an A/B run, as the comparison reads it from that side's bundle."""

    verdict: VerdictKind
    summary: str
    exit_code: int
    # The side's bundle folder, relative to the A/B bundle folder ("" when not recorded).
    bundle: str = ""
    report: str | None = None        # the side's report.html, relative to the A/B output folder
    engines: dict[str, ABEngine] = Field(default_factory=dict)


class ABComparison(_Model):
    stock: ABSide
    fixed: ABSide
    separated: bool                  # stock reproduced a hang and fixed is healthy

    @property
    def outcome(self) -> str:
        """An A/B's one outcome, as report.json's ``outcome`` names it."""
        return "ab_separated" if self.separated else "ab_not_separated"

    @property
    def title(self) -> str:
        return "A/B separated" if self.separated else "A/B did not separate"

    def headline(self) -> str:
        """``A/B separated (stock: gil_cycle, fixed: healthy)``: what heads every rendering of an A/B."""
        return f"{self.title} (stock: {self.stock.verdict.value}, fixed: {self.fixed.verdict.value})"


class WaitPurpose(str, Enum):
    """What a thread that is not running waits for."""

    NEW_WORK = "new_work"      # a server's accept/poll, a worker's task queue, a timer loop: idle by design
    OUTCOME = "outcome"        # the result of work already started: join, a result, a lock, a reply, a child
    RUNNING = "running"
    OTHER = "other"            # a GIL wait, a read whose purpose the frames do not say, a state no tool read


class ThreadWait(_Model):
    """One thread's wait purpose as the analyzer judged it (shown per thread in every report)."""

    pid: int
    node: str | None = None
    tid: int
    name: str | None = None
    purpose: WaitPurpose
    what: str
    advanced: bool | None = None   # its own observation in the window (None: not observed)
    stuck: bool = False            # an outcome-wait that did not advance


class Diagnosis(_Model):
    """analyze(bundle): everything the run concluded. Stored in the bundle; renderers read only this."""

    verdict: Verdict
    verdicts_by_engine: dict[str, Verdict] = Field(default_factory=dict)
    exit_code: int = 0
    ab: ABComparison | None = None
    notes: list[str] = Field(default_factory=list)   # how the run-level judgement changed the verdict
    # Every wait edge found across the captured processes (None: not built, or a bundle from before it).
    wait_graph: WaitGraphRecord | None = None
    # Each engine's health line and banner risks, judged with its verdict (None: a bundle from before they
    # were stored; kvdiag.analyze.diagnosis.complete fills them in before rendering).
    engines: list[EngineJudgement] | None = None
    # Every captured thread's wait purpose (None: a bundle from before it was stored).
    thread_waits: list[ThreadWait] | None = None
