"""The bundle: everything one run captured, written as bundle/bundle.json."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from kvdiag.model.environment import EnvironmentRecord, HostRecord
from kvdiag.model.evidence import ProcessEvidence, RedactionSummary
from kvdiag.model.fleet import FleetRecord
from kvdiag.model.kinds import SCHEMA_VERSION, _Model
from kvdiag.model.run import EngineRecord, Finding, MetricsSnapshot, SoakStats, TimelineEvent
from kvdiag.model.verdict import Diagnosis


class Bundle(_Model):
    """Everything one run captured. Written as bundle/bundle.json."""

    schema_version: str = SCHEMA_VERSION
    kvdiag_version: str = ""
    command: str = ""
    created_at: str = ""             # ISO-8601 UTC
    host: HostRecord = Field(default_factory=HostRecord)
    scenario: dict[str, object] | None = None
    scenario_path: str | None = None
    stall_window_s: float | None = None
    engines: list[EngineRecord] = Field(default_factory=list)
    processes: list[ProcessEvidence] = Field(default_factory=list)
    timeline: list[TimelineEvent] = Field(default_factory=list)
    metrics: list[MetricsSnapshot] = Field(default_factory=list)
    soak: SoakStats | None = None
    findings: list[Finding] = Field(default_factory=list)
    stall_detected: bool = False     # the watcher saw no progress for the stall window
    interrupted: bool = False
    interrupted_reason: str | None = None   # "interrupted (Ctrl-C)", "received SIGTERM", ...
    # Nested runs (``kvdiag ab``): label -> that run's bundle folder, relative to this bundle folder.
    runs: dict[str, str] = Field(default_factory=dict)
    # What analyze said about this bundle when the run wrote it; renderers read only this.
    diagnosis: Diagnosis | None = None
    environment: EnvironmentRecord | None = None   # the machine it ran on (kvdiag.environment)
    redaction: RedactionSummary = Field(default_factory=RedactionSummary)
    stall_to_verdict_s: float | None = None   # "stall detected" → verdict, seconds (capture, analysis)
    fleet: FleetRecord | None = None   # a bundle merged from several hosts (Ray cluster, ``kvdiag merge``)

    @model_validator(mode="before")
    @classmethod
    def _host_machine(cls, data: Any) -> Any:
        """Bundles whose host record has no machine (repro, ab and soak wrote none): the environment's."""
        if not isinstance(data, dict):
            return data
        host, env = data.get("host", {}), data.get("environment")
        if isinstance(host, dict) and not host.get("machine") and isinstance(env, dict) and env.get("machine"):
            data = {**data, "host": {**host, "machine": env["machine"]}}
        return data


Bundle.model_rebuild()
