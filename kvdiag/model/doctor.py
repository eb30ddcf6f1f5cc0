"""What `kvdiag doctor` judged: one check per known risk and subject."""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from kvdiag.model.environment import EnvironmentRecord
from kvdiag.model.kinds import SCHEMA_VERSION, _Model


class RiskStatus(str, Enum):
    RISK = "risk"            # a known hang risk applies: `kvdiag doctor` exits 10
    WARN = "warn"            # worth fixing, not a hang risk (e.g. capture would be refused)
    OK = "ok"
    UNKNOWN = "unknown"
    NOT_APPLICABLE = "n/a"


class DoctorCheck(_Model):
    """One known risk judged for one subject (the host, a GPU, a scenario engine, a log's banner)."""

    check: str                       # "prealloc_pool", "colocation", "allocator_build", "headroom", "page_vs_block"
    subject: str
    status: RiskStatus
    detail: str
    fix: str | None = None
    upstream: str | None = None      # "kvcached #371 (PR #422)"


class DoctorReport(_Model):
    """What `kvdiag doctor --json` prints."""

    schema_version: str = SCHEMA_VERSION
    kvdiag_version: str = ""
    scenario: str | None = None
    logs: list[str] = Field(default_factory=list, description="The logs (--log) whose banners were judged.")
    environment: EnvironmentRecord
    checks: list[DoctorCheck] = Field(default_factory=list)
    risky: bool = False
    exit_code: int = 0
