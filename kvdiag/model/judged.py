"""What analyze judged about each engine from its record and its verdict: the health line and the
banner risks. Stored in the diagnosis so every renderer shows the same judgement without making it."""

from __future__ import annotations

from pydantic import Field

from kvdiag.model.kinds import _Model
from kvdiag.model.run import BannerRisk


class EngineJudgement(_Model):
    """One engine as the diagnosis judged it (``diagnosis.engines[]``, in the bundle's engine order)."""

    name: str
    # The engine's verdict is healthy (a stalled engine whose /health still answers is not).
    healthy: bool = False
    health: str = ""                 # "yes", "no (decode stall; /health still answered)"
    health_note: str | None = None   # what /health said when it matters
    banner_risks: list[BannerRisk] = Field(default_factory=list)   # one per banner, in the record's order
    banner_risk: BannerRisk | None = None   # all banners' risks combined; None without a banner
