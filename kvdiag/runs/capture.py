"""A running engine's capture as a run: ``kvdiag capture``'s, and ``kvdiag watch``'s when it names a stall.

The target (a pid, or the one EngineCore under an API server) -> the scope it may touch -> a staged
capture in which the EngineCore's evidence may decide alone (:func:`core_decides`) -> the verdict as
soon as the evidence is in -> the tail every run shares (:func:`kvdiag.runs.output.finish`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvdiag.capture.access import is_kernel_thread
from kvdiag.capture.bundle import capture_tree
from kvdiag.capture.orchestrate import make_backends
from kvdiag.capture.ranks import job_ranks
from kvdiag.capture.select import Scope, capture_scope, engine_cores_of
from kvdiag.defaults import Clock
from kvdiag.environment.host import host_record
from kvdiag.errors import UsageError
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import ProcessRole
from kvdiag.model.run import Finding
from kvdiag.model.verdict import Diagnosis
from kvdiag.osread.stat import read_stat

if TYPE_CHECKING:   # the analysis and the reports load beside the capture (see _warm_up), not before it
    from kvdiag.runs.output import RunArtifacts


def core_decides(evidence: list[ProcessEvidence], findings: list[Finding]) -> str | None:
    """Whether the EngineCore's evidence already names its hang (the rest of the tree then needs no pausing
    tool): the reason, else None. Judged with this host's syscall table, as the finished bundle is."""
    from kvdiag.analyze.overall import analyze

    v = analyze(Bundle(host=host_record(), processes=evidence, findings=findings))
    cores = {e.pid for e in evidence if e.role is ProcessRole.ENGINE_CORE}
    if v.kind.is_hang and any(item.pid in cores for item in v.evidence):
        return f"the EngineCore's evidence decided ({v.kind.value})"
    return None


def ranks_decide(evidence: list[ProcessEvidence], findings: list[Finding]) -> str | None:
    """Whether the job's ranks, read without pausing them, already say where each is (the other ranks
    then need no pausing tool), or the engine core's evidence decides: the reason, else None."""
    from kvdiag.analyze.ranks import ranks_settled

    return ranks_settled(Bundle(host=host_record(), processes=evidence, findings=findings)) or core_decides(
        evidence, findings)


def target_pid(pid: int | None, engine_core_of: int | None) -> int:
    """The pid to capture: --pid as given, or the one EngineCore under --engine-core-of."""
    if (pid is None) == (engine_core_of is None):
        raise UsageError("give exactly one of --pid PID and --engine-core-of API_SERVER_PID")
    if pid is not None:
        if pid <= 0 or read_stat(pid) is None:
            raise UsageError(f"--pid {pid}: no such process",
                             hint="pass the pid of the EngineCore, or --engine-core-of API_SERVER_PID")
        if pid == os.getpid():
            raise UsageError("--pid: refusing to capture kvdiag itself")
        return pid
    assert engine_core_of is not None
    if engine_core_of <= 0 or read_stat(engine_core_of) is None:
        raise UsageError(f"--engine-core-of {engine_core_of}: no such process")
    cores = engine_cores_of(engine_core_of)
    if not cores:
        raise UsageError(f"--engine-core-of {engine_core_of}: no VLLM::EngineCore process under it",
                         hint="pass the pid of a vLLM API server (`vllm serve`), or --pid of the process itself")
    if len(cores) > 1:
        raise UsageError(f"--engine-core-of {engine_core_of}: {len(cores)} EngineCore processes under it "
                         f"({', '.join(map(str, cores))})", hint="pick one with --pid")
    return cores[0]


def checked_tools(timeout: float, tools: str | list[str], via: str = "auto") -> list[str]:
    """The tool names of ``--tools`` (with the agent's for ``--via agent``), once ``--timeout``, ``--via`` and
    every name are known good (UsageError if not)."""
    if not 0 < timeout <= 600:
        raise UsageError(f"--timeout {timeout}: must be in (0, 600] seconds")
    if via not in ("auto", "agent"):
        raise UsageError(f"--via {via}: one of auto, agent")
    names = [t.strip() for t in tools.split(",") if t.strip()] if isinstance(tools, str) else list(tools)
    if via == "agent" and "agent" not in names:
        names.append("agent")
    try:
        make_backends(names)
    except ValueError as exc:
        raise UsageError(f"--tools: {exc}") from None
    return names


def scope_of(target: int, all_descendants: bool = False) -> Scope:
    """The processes of ``target``'s tree the capture may touch (UsageError: a tree that is not one engine).

    A kernel thread is not refused here: only it is looked at, through /proc, and nothing attaches to it
    (an outcome with a report, kernel_thread, exit 5)."""
    if is_kernel_thread(target):
        return Scope(root=target, pids=[target], problems=[])
    scope = capture_scope(target)
    if scope.problems and not all_descendants:
        raise UsageError(f"refusing to capture pid {target}: " + "; ".join(scope.problems),
                         hint="name the engine: --engine-core-of API_SERVER_PID (or --pid of its EngineCore); "
                         "--all-descendants captures the whole tree anyway")
    return scope


def capture_run(target: int, scope: Scope, out_dir: Path, *, timeout_s: float, tools: list[str], command: str,
                follow: bool = True, record: Callable[[Bundle], None] | None = None,
                on_verdict: Callable[[Diagnosis], None] | None = None,
                verdict_t: Clock | None = None,
                progress: Callable[[str], None] | None = None) -> RunArtifacts:
    """Capture ``target``'s ``scope`` read-only into ``out_dir/bundle``, analyzed and rendered.

    ``record``: what the caller saw, added to the bundle before it is judged (the watch's metrics).
    ``on_verdict``: the diagnosis as soon as the evidence is in, before the environment and the reports.
    ``verdict_t``: the run time of the verdict, for its timeline (the watch's stall-to-verdict)."""
    kthread = scope.pids == [target] and is_kernel_thread(target)
    # One rank of a distributed job is judged with its group: the job's other ranks on this host come too.
    ranks = [] if kthread else job_ranks(scope.pids)
    if progress is not None:
        also = f" and {len(ranks)} other rank{'s' if len(ranks) > 1 else ''} of its job" if ranks else ""
        progress(f"pid {target} is a kernel thread: capture refused; recording what /proc shows" if kthread else
                 f"capturing pid {target} and its children{also} with {', '.join(tools)} "
                 f"(read-only; the tools stop after --timeout {timeout_s:g} s)")
    bundle, known = capture_evidence(target, scope.pids, out_dir / "bundle", timeout_s=timeout_s, tools=tools,
                                     command=command, follow=follow and not kthread, ranks=ranks, record=record,
                                     on_verdict=on_verdict, progress=progress)
    from kvdiag.runs.output import finish

    return finish(out_dir, bundle, verdict_t=verdict_t() if verdict_t is not None else None, diagnosis=known)


def capture_evidence(target: int, pids: list[int], bundle_dir: Path, *, timeout_s: float, tools: list[str],
                     command: str, follow: bool = True, ranks: list[int] | None = None,
                     log_pids: dict[str, int] | None = None, record: Callable[[Bundle], None] | None = None,
                     on_verdict: Callable[[Diagnosis], None] | None = None,
                     progress: Callable[[str], None] | None = None) -> tuple[Bundle, Diagnosis | None]:
    """The capture every run of a running engine shares (capture, watch, soak): ``pids`` of ``target``'s tree
    (and the job's other ``ranks``) read-only into ``bundle_dir``, the EngineCore first and the rest with every
    tool only when its evidence does not decide; the bundle (not saved) and the diagnosis of its evidence,
    made as soon as the evidence was in (None when the capture ended before that).

    ``log_pids``: the engine's processes as its log named them (a launched engine), else found from the tree."""
    known: list[Diagnosis] = []
    said_paths: set[str] = set()

    def say_paths(b: Bundle) -> None:
        # which path read each process (ptrace tools or the in-process agent), said before the verdict
        for f in b.findings:
            if f.kind == "capture_path" and progress is not None and f.message not in said_paths:
                said_paths.add(f.message)
                progress(f.message)

    def early(partial: Bundle) -> None:
        from kvdiag.analyze.diagnosis import diagnose
        from kvdiag.redact.bundle import redact_bundle

        say_paths(partial)
        if record is not None:
            record(partial)
        known.append(diagnose(redact_bundle(partial)))
        if on_verdict is not None:
            on_verdict(known[0])

    # The analysis, the reports and their template load while the /proc window is open and the tools wait on
    # their targets (``beside``): before the capture they would delay the window by a third of a second.
    # Ctrl-C and SIGTERM raise here (kvdiag.interrupts): the capture kills its tools on the way out.
    bundle = capture_tree(target, bundle_dir, timeout_s=timeout_s, backends=tools, command=command,
                          pids=pids + (ranks or []), log_pids=log_pids, save=False, on_evidence=early,
                          decides=ranks_decide if ranks else core_decides, focus=pids if ranks else None,
                          follow=follow, beside=_warm_up)
    say_paths(bundle)
    if not known and record is not None:
        record(bundle)
    return bundle, known[0] if known else None


def _warm_up() -> None:
    """Import what judges and renders the capture (and compile the report's template) in the background.
    A failure here is raised again where the module is used, with its report."""
    try:
        import kvdiag.analyze.diagnosis  # noqa: F401
        import kvdiag.redact.bundle  # noqa: F401
        import kvdiag.report.terminal  # noqa: F401
        import kvdiag.runs.output  # noqa: F401
        from kvdiag.report.html import compile_templates

        compile_templates()
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def capture_cluster_run(address: str, out_dir: Path, *, select: str, patterns: list[str], timeout_s: float,
                        tools: list[str], progress: Callable[[str], None]) -> RunArtifacts:
    """``capture --ray``: the same capture on every node of a Ray cluster, merged into one bundle."""
    from kvdiag.runs.fleet.ray import capture_cluster
    from kvdiag.runs.output import finish

    bundle = capture_cluster(address, out_dir / "bundle", select=select, patterns=patterns, timeout_s=timeout_s,
                             backends=tools, progress=progress)
    return finish(out_dir, bundle)
