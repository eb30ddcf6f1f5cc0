"""What an engine's log says about how it ended or how far it got. Pure: reads the EngineRecord only.

- the line a crash summary names: the exception that ends a traceback (``OSError: ...``), never the
  traceback's header, which says only that one follows;
- a process still starting: its phase and its last start-up line (``loading shard 17/40``), and whether
  the log still advanced when it was captured.
"""

from __future__ import annotations

import re

from kvdiag.defaults import STALL_WINDOW_S
from kvdiag.model.kinds import Confidence, EnginePhase, VerdictKind
from kvdiag.model.run import EngineRecord
from kvdiag.model.verdict import Verdict

TELLING = re.compile(r"\b[\w.]*(Error|Exception)\b: |Fatal Python error|killed by signal|died unexpectedly|"
                     r"Killed process|initialization failed|Segmentation fault|Aborted|terminate called")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")

STARTING = (EnginePhase.LAUNCHING, EnginePhase.LOADING, EnginePhase.PROFILING, EnginePhase.KV_INIT,
            EnginePhase.BANNER)
# A start-up progress counter: "17/40", "shard 17 of 40", "45%".
_COUNTER = re.compile(r"\b\d+\s*/\s*\d+\b|\b\d+ of \d+\b|\b\d{1,3}%")


def telling_line(text: str, pattern: re.Pattern[str]) -> str:
    """The line that says what happened, among ``text``'s lines that match ``pattern``: an exception or
    signal line over a bare 'Traceback'. When the traceback header is all that matched, the exception line
    that ends the first traceback answers it (the root cause; vLLM's later "Engine core initialization
    failed. See root cause above" points back at it)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if pattern.search(ln)]
    best = [ln for ln in hits if TELLING.search(ln) and not _TRACEBACK.search(ln)]
    real = [ln for ln in best if "root cause" not in ln.lower()]   # not vLLM's pointer back at the cause
    if real or best:
        return (real or best)[-1]
    plain = [ln for ln in hits if not _TRACEBACK.search(ln) and "root cause" not in ln.lower()]
    if plain:
        return plain[-1]
    header = next((i for i, ln in enumerate(lines) if _TRACEBACK.search(ln)), None)
    if header is not None:
        after = [ln for ln in lines[header + 1:] if TELLING.search(ln) and not _TRACEBACK.search(ln)]
        root = [ln for ln in after if "root cause" not in ln]
        if root or after:
            return (root or after)[0]
    return (hits or [""])[-1]


def starting_verdict(name: str, e: EngineRecord) -> Verdict:
    """``slow_start`` for an engine still in a start-up phase with no hang evidence, saying how far its log
    got and whether the log still advanced when it was captured."""
    last = (e.last_log_line or "").strip()
    progress = f": its log says `{last[:160]}`" if last and _COUNTER.search(last) else ""
    reasons = [f"+ phase {e.phase.value} from its log"]
    conf = Confidence.LOW
    if e.log_idle_s is not None:
        if e.log_idle_s <= STALL_WINDOW_S:
            conf = Confidence.MEDIUM
            reasons.append(f"+ its log was written {e.log_idle_s:.1f}s before the capture")
            progress += f" (written {e.log_idle_s:.1f}s before the capture: still advancing)"
        else:
            reasons.append(f"- its log has not been written for {e.log_idle_s:.0f}s")
            progress += f" (nothing written for {e.log_idle_s:.0f}s: slow or stuck in start-up)"
    return Verdict(kind=VerdictKind.SLOW_START, confidence=conf, confidence_reasons=reasons,
                   summary=f"{name}: still starting (phase {e.phase.value}), no hang evidence{progress}")
