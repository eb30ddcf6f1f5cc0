"""`kvdiag sweep` (and `kvdiag ab --repeat`): what a sweep ran, per cell and as a whole.

One cell is one setting of the varied fields; each of its runs is a full `repro` run with its own
output folder. Everything judged over the cells (rates, the rule, the banner check) is stored here,
so the renderers only render.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvdiag.model.kinds import _Model

SWEEP_SCHEMA_VERSION = "1"

Scalar = bool | int | float | str
RunOutcome = Literal["hang", "healthy", "crash", "inconclusive", "error"]
CellOutcome = Literal["hang", "healthy", "mixed", "crash", "inconclusive", "error", "pending"]


class SweepAxis(_Model):
    """One ``--vary FIELD=VALUES`` (or ``--bisect``): the field path as the user wrote it and its values."""

    field: str
    values: list[Scalar]
    label: str                        # short name in tables and the rule ("min_reserved_pages")
    bisect: bool = False              # searched for its boundary rather than walked in full


class SweepRun(_Model):
    """One run of a cell (one `repro` run), read from its report.json."""

    index: int
    outcome: RunOutcome
    exit_code: int
    verdict: str                      # the run's verdict kind
    signature: str | None = None
    engine: str | None = None         # the engine the verdict is about
    summary: str = ""
    time_to_hang_s: float | None = None      # hung engine: its launch → its last progress
    time_to_healthy_s: float | None = None   # first launch → every engine ready
    banner_risk: bool | None = None          # any engine's printed banner predicts the hang (None: no banner)
    banner_reasons: list[str] = Field(default_factory=list)
    wall_s: float = 0.0
    path: str = ""                    # the run's output folder, relative to the sweep folder


class Interval(_Model):
    """A binomial proportion's confidence interval."""

    low: float
    high: float
    level: float = 0.95
    method: str = "clopper-pearson"   # exact, two-sided


class Distribution(_Model):
    n: int
    min: float
    median: float
    p90: float
    max: float


class SweepCell(_Model):
    key: str
    params: dict[str, Scalar]                   # axis label → value
    features: dict[str, Scalar] = Field(default_factory=dict)   # what the rule may use (effective settings)
    notes: list[str] = Field(default_factory=list)              # e.g. a coupled field adjusted to stay valid
    runs: list[SweepRun] = Field(default_factory=list)
    repeat: int = 1
    outcome: CellOutcome = "pending"
    hangs: int = 0
    interval: Interval | None = None
    kinds: dict[str, int] = Field(default_factory=dict)
    signatures: dict[str, int] = Field(default_factory=dict)
    time_to_hang: Distribution | None = None
    time_to_healthy: Distribution | None = None
    banner_predicts_hang: bool | None = None
    rule_predicts_hang: bool | None = None


class SweepRule(_Model):
    """The boundary as a rule over the cells' features."""

    text: str                          # "hangs ⇔ prealloc on and pages per layer ≤ min_reserved_pages"
    fits: bool                         # classifies every decided cell correctly
    wrong: list[str] = Field(default_factory=list)       # keys of cells it gets wrong
    mixed: list[str] = Field(default_factory=list)       # keys of cells that hung in some runs only
    context: list[str] = Field(default_factory=list)     # settings equal in every cell ("allocator stock")
    alternatives: list[str] = Field(default_factory=list)   # other rules of the same size that also fit
    decided: int = 0                   # cells the rule was fitted on


class BannerDisagreement(_Model):
    key: str
    params: dict[str, Scalar]
    observed: str                      # the cell's outcome
    banner: str                        # "risk" | "no risk" | "no banner"
    reasons: list[str] = Field(default_factory=list)


class BannerCheck(_Model):
    """The observed outcomes against the banner's static risk rule (kvdiag/kvcached/banner.py)."""

    rule: str
    agree: bool
    checked: int
    disagreements: list[BannerDisagreement] = Field(default_factory=list)
    text: str = ""


class RateLine(_Model):
    """One side of an A/B with repeats: k of n hung, with its interval."""

    label: str
    runs: int
    hangs: int
    healthy: int
    interval: Interval
    text: str                          # "fixed 0/10 hung, 95 % upper bound 31 %"


class ABRates(_Model):
    stock: RateLine
    fixed: RateLine
    separated: bool                    # every fixed run healthy and the stock allocator reproduced the hang
    intervals_disjoint: bool           # the two 95 % intervals do not overlap
    text: str


class SweepReport(_Model):
    """OUT/report.json of `kvdiag sweep` and `kvdiag ab --repeat`."""

    schema_version: str = SWEEP_SCHEMA_VERSION
    report_kind: Literal["sweep"] = "sweep"
    kvdiag_version: str = ""
    command: str = "sweep"
    created_at: str = ""
    scenario: str = ""
    axes: list[SweepAxis] = Field(default_factory=list)
    engines_left_out: list[str] = Field(default_factory=list)   # `--engines`: scenario engines not started
    repeat: int = 1
    jobs: int = 1
    stall_window_s: float | None = None
    interval_method: str = "Clopper-Pearson exact, two-sided 95 %"
    cells: list[SweepCell] = Field(default_factory=list)
    cells_planned: int = 0
    finished: bool = False
    interrupted: bool = False
    rule: SweepRule | None = None
    boundaries: list[str] = Field(default_factory=list)   # `--bisect`: where the outcome changes, per line
    banner_check: BannerCheck | None = None
    ab: ABRates | None = None
    exit_code: int = 0
    summary: str = ""
    wall_s: float = 0.0
