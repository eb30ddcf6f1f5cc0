"""Each engine's judgement beside its verdict: the health line and the risk of every banner it printed.

Judged once, where the diagnosis is made, and stored in it (``Diagnosis.engines``): renderers show it.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvdiag.kvcached.banner import assess_risk_for
from kvdiag.model.bundle import Bundle
from kvdiag.model.health import engine_health
from kvdiag.model.judged import EngineJudgement
from kvdiag.model.run import BannerRisk, EngineRecord
from kvdiag.model.verdict import ABComparison, Diagnosis, Verdict


def combined_risk(risks: list[BannerRisk]) -> BannerRisk | None:
    """All banners' risks as one: risky if any is, the fewest pages per layer, every reason once, and the risk
    under load of the first banner that leaves one open (so an engine's banner column says what `kvdiag banner`
    says of the same banner)."""
    if not risks:
        return None
    reasons: list[str] = []
    for risk in risks:
        reasons.extend(r for r in risk.reasons if r not in reasons)
    return BannerRisk(risky=any(r.risky for r in risks), pages_per_layer=min(r.pages_per_layer for r in risks),
                      reasons=reasons, load_risk=next((r.load_risk for r in risks if r.load_risk), None))


def judge_engine(rec: EngineRecord, verdict: Verdict | None) -> EngineJudgement:
    """``rec`` judged with its own verdict (None: no verdict names it)."""
    risks = [assess_risk_for(b, rec.allocator) for b in rec.banners]
    health = engine_health(rec, verdict)
    return EngineJudgement(name=rec.name, healthy=health.healthy, health=health.line, health_note=health.note,
                           banner_risks=risks, banner_risk=combined_risk(risks))


def judge_engines(bundle: Bundle, verdicts_by_engine: Mapping[str, Verdict]) -> list[EngineJudgement]:
    """Every engine of ``bundle``, in its order, each with the verdict keyed by its name."""
    return [judge_engine(e, verdicts_by_engine.get(e.name)) for e in bundle.engines]


def diagnosis_of(bundle: Bundle, verdict: Verdict, *, exit_code: int,
                 verdicts_by_engine: dict[str, Verdict] | None = None,
                 ab: ABComparison | None = None) -> Diagnosis:
    """A diagnosis from a caller that holds verdicts but no stored diagnosis (a hand-built bundle): the
    engines' judgements are the stored ones when ``bundle``'s diagnosis holds these verdicts, else
    judged here, exactly as :func:`kvdiag.analyze.diagnosis.diagnose` stores them."""
    by_engine = dict(verdicts_by_engine or {})
    stored = bundle.diagnosis
    engines = stored.engines if stored is not None and stored.verdicts_by_engine == by_engine else None
    if engines is None:
        engines = judge_engines(bundle, by_engine)
    return Diagnosis(verdict=verdict, verdicts_by_engine=by_engine, exit_code=exit_code, ab=ab, engines=engines)



__all__ = ["combined_risk", "diagnosis_of", "judge_engine", "judge_engines"]
