"""The typed model that flows between pipeline stages.

Capture produces a :class:`Bundle`; analyzers read a bundle and return a
:class:`Verdict`; reporters render a :class:`Report` (bundle + verdict). Every
model here round-trips through JSON (``model_dump(mode="json")`` /
``model_validate``) so a bundle attached to someone else's bug can be
re-analyzed offline.

Conventions:
- frames are listed innermost first (index 0 is the frame executing now), like
  gdb and py-spy; pystack's outermost-first order is reversed on parse;
- times in the timeline are seconds since the run started (monotonic);
- paths inside a bundle are relative to the bundle folder.

One module per concern: kinds, evidence, gpu, run, environment, doctor, judged, verdict, bundle, report, waits,
health (what "healthy" means in every report, derived from an engine's record and verdict).
"""

from __future__ import annotations

from kvdiag.model.bundle import (
    Bundle,
)
from kvdiag.model.doctor import (
    DoctorCheck,
    DoctorReport,
    RiskStatus,
)
from kvdiag.model.environment import (
    DefectCheck,
    DefectStatus,
    EnvironmentRecord,
    GpuInfo,
    HostRecord,
    InterpreterPackages,
    IpcSocket,
    KvcachedBuild,
    KvcachedRuntime,
    PtraceAccess,
    ShmSegment,
)
from kvdiag.model.evidence import (
    FdInfo,
    Frame,
    KernelWait,
    ProcessEvidence,
    ProgressSample,
    RedactionSummary,
    TargetAccess,
    TcpSocket,
    ThreadEvidence,
    ThreadObservation,
    ToolRun,
)
from kvdiag.model.fleet import (
    FleetRecord,
    NodeOutcome,
    NodeRecord,
    RayActorRecord,
    RayTaskRecord,
)
from kvdiag.model.gpu import (
    GpuDeviceReading,
    GpuProcessUse,
    GpuReadings,
    GpuSnapshot,
)
from kvdiag.model.health import EngineHealth, engine_health
from kvdiag.model.judged import EngineJudgement
from kvdiag.model.kinds import (
    KIND_SPECS,
    NO_EVIDENCE_KINDS,
    SCHEMA_VERSION,
    TARGET_STATE_KINDS,
    Confidence,
    EnginePhase,
    GilState,
    KindSpec,
    ProcessRole,
    ThreadState,
    VerdictKind,
)
from kvdiag.model.ranks import (
    STEP_LOCALS,
    RankIdentity,
)
from kvdiag.model.report import (
    EnginePids,
    Report,
    ReportBanner,
    ReportEngine,
)
from kvdiag.model.rings import (
    RingGeometry,
    RingReading,
)
from kvdiag.model.run import (
    BannerInfo,
    BannerRisk,
    EngineRecord,
    Finding,
    MetricsSnapshot,
    SoakStats,
    TimelineEvent,
)
from kvdiag.model.soakseries import (
    SoakSample,
)
from kvdiag.model.sweep import (
    SWEEP_SCHEMA_VERSION,
    ABRates,
    BannerCheck,
    BannerDisagreement,
    Distribution,
    Interval,
    RateLine,
    Scalar,
    SweepAxis,
    SweepCell,
    SweepReport,
    SweepRule,
    SweepRun,
)
from kvdiag.model.verdict import (
    ABComparison,
    ABEngine,
    ABSide,
    Diagnosis,
    EvidenceItem,
    KnownDefect,
    ThreadWait,
    Verdict,
    WaitPurpose,
)
from kvdiag.model.waits import (
    EdgeEvidence,
    EdgeKind,
    FrameRef,
    NodeRef,
    PeerProcess,
    SharedMapping,
    WaitChain,
    WaitEdge,
    WaitGraphRecord,
    WaitNode,
)

__all__ = [
    "EngineHealth",
    "EngineJudgement",
    "engine_health",
    "FleetRecord",
    "NodeOutcome",
    "NodeRecord",
    "RayActorRecord",
    "RayTaskRecord",
    "ABComparison",
    "ABEngine",
    "ABRates",
    "ABSide",
    "BannerCheck",
    "BannerDisagreement",
    "BannerInfo",
    "BannerRisk",
    "Bundle",
    "Confidence",
    "DefectCheck",
    "DefectStatus",
    "Diagnosis",
    "ThreadWait",
    "WaitPurpose",
    "Distribution",
    "DoctorCheck",
    "DoctorReport",
    "EdgeEvidence",
    "EdgeKind",
    "EnginePhase",
    "EnginePids",
    "EngineRecord",
    "EnvironmentRecord",
    "HostRecord",
    "EvidenceItem",
    "FdInfo",
    "Finding",
    "Frame",
    "FrameRef",
    "GilState",
    "GpuDeviceReading",
    "GpuInfo",
    "GpuProcessUse",
    "GpuReadings",
    "GpuSnapshot",
    "InterpreterPackages",
    "Interval",
    "IpcSocket",
    "KIND_SPECS",
    "KindSpec",
    "KnownDefect",
    "KvcachedBuild",
    "KvcachedRuntime",
    "MetricsSnapshot",
    "NO_EVIDENCE_KINDS",
    "NodeRef",
    "PeerProcess",
    "ProcessEvidence",
    "ProcessRole",
    "KernelWait",
    "ProgressSample",
    "RingGeometry",
    "RingReading",
    "PtraceAccess",
    "RankIdentity",
    "STEP_LOCALS",
    "RateLine",
    "RedactionSummary",
    "Report",
    "ReportBanner",
    "ReportEngine",
    "RiskStatus",
    "SCHEMA_VERSION",
    "Scalar",
    "SWEEP_SCHEMA_VERSION",
    "SharedMapping",
    "ShmSegment",
    "SoakSample",
    "SoakStats",
    "SweepAxis",
    "SweepCell",
    "SweepReport",
    "SweepRule",
    "SweepRun",
    "TARGET_STATE_KINDS",
    "TargetAccess",
    "TcpSocket",
    "ThreadEvidence",
    "ThreadObservation",
    "ThreadState",
    "TimelineEvent",
    "ToolRun",
    "Verdict",
    "VerdictKind",
    "WaitChain",
    "WaitEdge",
    "WaitGraphRecord",
    "WaitNode",
]
