"""An engine's health line, derived from its verdict and its probes (one source of truth).

"healthy" in every report means "this engine's verdict is healthy": a stalled engine whose
/health still answers is not healthy, and a healthy verdict is never shown beside "healthy: no".
What the probe said is kept apart and named in the line, so nothing is hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.model.kinds import EnginePhase, VerdictKind
from kvdiag.model.run import EngineRecord
from kvdiag.model.verdict import Verdict


@dataclass(frozen=True)
class EngineHealth:
    healthy: bool
    line: str        # "yes", "no (gil cycle; /health still answered)", ...
    note: str | None = None   # what the probe said when it matters: "/health still answered", ...


def engine_health(rec: EngineRecord, verdict: Verdict | None) -> EngineHealth:
    """The health line of ``rec`` given its verdict (None: no verdict, probes and phase only)."""
    probed = rec.url is not None
    answered = rec.healthy
    if verdict is None:
        ok = answered and rec.phase not in (EnginePhase.STALLED, EnginePhase.EXITED)
        if ok:
            return EngineHealth(True, "yes")
        if answered:
            return EngineHealth(False, "no (/health still answered)", "/health still answered")
        return EngineHealth(False, "no")
    if verdict.kind is VerdictKind.HEALTHY:
        if probed and not answered:
            return EngineHealth(True, "yes (no hang evidence; /health did not answer at the end)",
                                "/health did not answer at the end")
        return EngineHealth(True, "yes")
    why = verdict.kind.value.replace("_", " ")
    if answered:
        return EngineHealth(False, f"no ({why}; /health still answered)", "/health still answered")
    return EngineHealth(False, f"no ({why})")
