"""report.json's shape: its field names are the user-facing contract."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvdiag.model.environment import EnvironmentRecord, HostRecord
from kvdiag.model.evidence import RedactionSummary
from kvdiag.model.kinds import SCHEMA_VERSION, EnginePhase, VerdictKind, _Model
from kvdiag.model.run import BannerInfo, BannerRisk, Finding, SoakStats, TimelineEvent
from kvdiag.model.verdict import ABComparison, ThreadWait, Verdict


class EnginePids(BaseModel):
    """An engine's process ids by role, as report.json shows them: ``api_server`` and ``engine_core``
    always (null when unknown), any other role the log named ("worker") after them."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, int | None] = Field(init=False)

    api_server: int | None = None
    engine_core: int | None = None

    @classmethod
    def of(cls, pids: dict[str, int]) -> EnginePids:
        """From an engine record's ``pids`` (role -> pid)."""
        return cls.model_validate(dict(pids))

    def by_role(self) -> dict[str, int | None]:
        """Role -> pid, the two named roles first."""
        out: dict[str, int | None] = {"api_server": self.api_server, "engine_core": self.engine_core}
        out.update(self.__pydantic_extra__ or {})
        return out


class ReportBanner(BannerInfo):
    """One banner in ``report.engines[].banners``: the parsed line and its risk for that engine's allocator."""

    risk: BannerRisk


class ReportEngine(_Model):
    """One ``report.engines[]`` item: the engine record plus its banner risk, health line and own verdict."""

    name: str
    allocator: str | None = None     # stock | fixed | external
    phase: EnginePhase = EnginePhase.NOT_STARTED
    # Healthy means the engine's verdict is healthy (kvdiag.model.health): a stalled engine is not,
    # even when its /health still answers; what /health said is kept apart and named in the health line.
    healthy: bool = False
    health: str = ""                 # "yes", "no (decode stall; /health still answered)"
    health_note: str | None = None
    health_endpoint_ok: bool = False
    url: str | None = None
    exit_code: int | None = None
    pids: EnginePids = Field(default_factory=EnginePids)
    startup_s: float | None = None
    banner: BannerInfo | None = None           # the first banner the engine printed
    banners: list[ReportBanner] = Field(default_factory=list)
    banner_risk: BannerRisk | None = None      # all banners' risks combined; None without a banner
    last_log_line: str | None = None
    log_path: str | None = None
    log_tail: list[str] = Field(default_factory=list)
    error: str | None = None
    verdict: VerdictKind | None = None
    verdict_summary: str | None = None


class Report(_Model):
    """report.json. Field names here are the user-facing contract."""

    schema_version: str = SCHEMA_VERSION
    kvdiag_version: str = ""
    command: str = ""
    created_at: str = ""
    exit_code: int = 0
    verdict: Verdict
    verdicts_by_engine: dict[str, Verdict] = Field(default_factory=dict)
    engines: list[ReportEngine] = Field(default_factory=list)
    timeline: list[TimelineEvent] = Field(default_factory=list)
    findings: list[Finding] = Field(default_factory=list)
    soak: SoakStats | None = None
    ab: ABComparison | None = None   # `kvdiag ab`: both runs side by side (the bundle's diagnosis.ab)
    bundle_path: str | None = None
    # Added by the report stage: environment and run context for the human reader.
    host: HostRecord = Field(default_factory=HostRecord)
    scenario: str | None = None      # scenario name or path the run used
    stall_window_s: float | None = None
    interrupted: bool = False        # the run was cut short; the report holds what it got
    environment: EnvironmentRecord | None = None
    redaction: RedactionSummary = Field(default_factory=RedactionSummary)
    stall_to_verdict_s: float | None = None   # "stall detected" → verdict, seconds
    # What the run concluded, in one word: the verdict's kind, or for `kvdiag ab` the comparison
    # (``ab_separated`` / ``ab_not_separated``; ``verdict`` is then the stock side's, its evidence).
    outcome: str | None = None
    # Engines that were kvdiag's simulated engines, not a real vLLM (their model name is a label).
    simulated_engines: list[str] = Field(default_factory=list)
    # Every captured thread's wait: for new work, for the outcome of work already started, running (and whether
    # it advanced over the observed window). Empty: a bundle from before it was judged.
    thread_waits: list[ThreadWait] = Field(default_factory=list)
