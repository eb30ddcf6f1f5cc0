"""How sure a healthy verdict is: from evidence (a probe answered, tokens under load, stacks without
a hang), never from timing noise, with its reasons stated.
"""

from __future__ import annotations

from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import Confidence, EnginePhase
from kvdiag.model.run import EngineRecord


def healthy_confidence(e: EngineRecord | None, procs: list[ProcessEvidence], bundle: Bundle,
                       basis: tuple[str, bool] | None = None) -> tuple[Confidence, list[str]]:
    """How sure a healthy verdict is, from evidence alone, and why.

    Whether a thread happened to be on a CPU when it was sampled is timing noise (an idle
    engine and a busy one are equally healthy), so it never counts. What counts: the engine
    answered its probe, tokens kept flowing under load, and captured stacks that show no hang
    (lowered when a capture tool failed), but only with observed progress or every thread idle on new work
    behind them (kvdiag.analyze.outcome.health_basis). Two independent witnesses: high; one: medium; none: low.
    """
    plus: list[str] = []
    minus: list[str] = []
    if e is not None and (e.healthy or e.phase is EnginePhase.SERVING):
        plus.append("the engine answered its readiness/health probe")
    soak = bundle.soak
    if soak is not None and not soak.stalled and soak.tokens > 0 and soak.requests_ok > 0:
        plus.append(f"tokens kept flowing under load ({soak.tokens} tokens, {soak.requests_ok} requests)")
    if procs:
        failed = sorted({t.tool for p in procs for t in p.tools if not t.ok})
        if failed and not any(t.ok and t.tool != "proc" for p in procs for t in p.tools):
            minus.append(f"no stack tool succeeded ({', '.join(failed)})")
        elif basis is not None and basis[1]:
            plus.append(f"the stacks of {len(procs)} captured process(es) show no hang pattern, and {basis[0]}")
        else:
            # Stacks alone are no witness of health: a hang that matches no pattern looks the same.
            minus.append(basis[0] if basis is not None else "progress was not observed")
    else:
        minus.append("no stacks were captured")
    if e is None and not procs:
        minus.append("no engine record and no probe")
    level = len(plus)
    conf = Confidence.HIGH if level >= 2 else Confidence.MEDIUM if level == 1 else Confidence.LOW
    return conf, [f"+ {r}" for r in plus] + [f"- {r}" for r in minus]
