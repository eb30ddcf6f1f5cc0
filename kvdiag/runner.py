"""Sequence the pipeline for scenario commands: launch → watch → capture → analyze → report.

CLI modules stay thin and call in here; every stage is reached only through
its package's public functions and the Bundle passed between them.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kvdiag import __version__
from kvdiag.bundle_io import save_bundle
from kvdiag.errors import ExitCode, Interrupted, KvdiagError, UsageError
from kvdiag.launch.process import ProcessSet, private_temp_path
from kvdiag.launch.reaper import run_device_name
from kvdiag.launch.session import EngineWatch, Outcome, RunResult, ScenarioRun
from kvdiag.model import (
    Bundle,
    Confidence,
    ProcessEvidence,
    ProcessRole,
    TimelineEvent,
    Verdict,
    VerdictKind,
)
from kvdiag.scenario.models import Scenario


def default_out_dir(command: str) -> Path:
    """reports/<command>-<timestamp>-<random>/ under the current directory (never reused)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("reports") / f"{command.replace(' ', '-')}-{stamp}-{secrets.token_hex(2)}"


def prepare_out_dir(out: Path | None, command: str) -> Path:
    path = out if out is not None else default_out_dir(command)
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / "bundle").mkdir(exist_ok=True)
        probe = path / ".kvdiag-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write output folder {path}: {exc.strerror or exc}",
                         hint="pass --out DIR pointing at a writable folder") from None
    return path


def host_info() -> dict[str, str]:
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpus": str(os.cpu_count() or 0)}


def new_bundle(command: str) -> Bundle:
    from kvdiag.environment import collect_environment

    return Bundle(kvdiag_version=__version__, command=command, host=host_info(),
                  created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  environment=collect_environment())


@dataclass
class RunArtifacts:
    out_dir: Path
    bundle: Bundle
    verdict: Verdict
    verdicts_by_engine: dict[str, Verdict]
    exit_code: int
    paths: dict[str, Path]


def _capture_engines(watches: list[EngineWatch], bundle_dir: Path, tools: list[str], timeout_s: float,
                     bundle: Bundle) -> None:
    """Capture every process of each given engine into the bundle (read-only)."""
    from kvdiag.capture import capture_processes, find_engine_processes

    for w in watches:
        if w.proc.pid is None:
            continue
        roles = find_engine_processes(w.proc.pid, dict(w.state.pids))
        pids: list[int] = []
        for role in (ProcessRole.ENGINE_CORE, ProcessRole.API_SERVER, ProcessRole.WORKER, ProcessRole.OTHER):
            for pid in roles.get(role, []):
                if pid not in pids:
                    pids.append(pid)
        if not pids:
            pids = [w.proc.pid]
        raw_dir = bundle_dir / "raw" / w.spec.name
        evidence, findings = capture_processes(pids, raw_dir, timeout_s=timeout_s, backends=tools)
        for ev in evidence:
            ev.engine = w.spec.name
            for role, role_pids in roles.items():
                if ev.pid in role_pids:
                    ev.role = role
        _relativize(evidence, bundle_dir)
        redact_tree(raw_dir)
        bundle.processes.extend(evidence)
        for f in findings:
            f.engine = f.engine or w.spec.name
        bundle.findings.extend(findings)


def _relativize(evidence: list[ProcessEvidence], bundle_dir: Path) -> None:
    for ev in evidence:
        for tool in ev.tools:
            if tool.raw_path and Path(tool.raw_path).is_absolute():
                try:
                    tool.raw_path = str(Path(tool.raw_path).relative_to(bundle_dir))
                except ValueError:
                    pass


def redact_tree(folder: Path) -> None:
    """Rewrite every text file under ``folder`` with secrets redacted (a safety net: capture already
    writes its raw outputs redacted)."""
    from kvdiag.redact import redact_tree as _redact_tree

    _redact_tree(folder)


def _copy_logs_redacted(raw_log_dir: Path, bundle_dir: Path, bundle: Bundle | None = None) -> None:
    """Copy the engines' raw logs into bundle/logs/, redacted; what was removed goes into the summary."""
    from kvdiag.redact import Tally, copy_redacted, note_file

    logs_dir = bundle_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    for src in sorted(raw_log_dir.glob("*.log")):
        tally = Tally()
        copy_redacted(src, logs_dir / src.name, tally)
        if bundle is not None:
            note_file(bundle.redaction, f"logs/{src.name}", tally.as_dict())


def analyze_bundle(bundle: Bundle) -> tuple[Verdict, dict[str, Verdict]]:
    from kvdiag.analyze import analyze, analyze_by_engine

    return analyze(bundle), analyze_by_engine(bundle)


def finish(out_dir: Path, bundle: Bundle, command: str, ab: dict[str, object] | None = None,
           verdict: Verdict | None = None, by_engine: dict[str, Verdict] | None = None,
           exit_code: int | None = None) -> RunArtifacts:
    """Analyze (unless given), save the bundle and write report.json/html/md."""
    from kvdiag.analyze import exit_code_for
    from kvdiag.report import write_outputs

    if verdict is None:
        verdict, by_engine = analyze_bundle(bundle)
    code = exit_code if exit_code is not None else exit_code_for(verdict)
    save_bundle(bundle, out_dir / "bundle")  # redacted there; bundle.redaction gets the summary
    paths = write_outputs(out_dir, bundle, verdict, command=command, exit_code=code,
                          verdicts_by_engine=by_engine or {}, ab=ab)
    return RunArtifacts(out_dir, bundle, verdict, by_engine or {}, code, paths)


def run_scenario(scenario: Scenario, scenario_name: str, scenario_text: str, out_dir: Path, command: str,
                 console: Console, allocator: str | None = None,
                 on_event: Callable[[str], None] | None = None) -> RunArtifacts:
    """Run a co-location scenario end to end and write its report into ``out_dir``."""
    if allocator is not None:
        for e in scenario.engines:
            if e.kind == "sim":
                e.allocator = allocator  # type: ignore[assignment]
    bundle = new_bundle(command)
    bundle.scenario = scenario.model_dump(mode="json")
    bundle.scenario_path = scenario_name
    bundle.stall_window_s = scenario.windows.stall_s
    bundle_dir = out_dir / "bundle"
    from kvdiag.redact import Tally, note_file, write_redacted

    tally = Tally()
    write_redacted(bundle_dir / "scenario.yaml", scenario_text, tally)
    note_file(bundle.redaction, "scenario.yaml", tally.as_dict())
    raw_log_dir = private_temp_path("kvdiag-logs-")  # created once the reaper knows it
    result: RunResult | None = None
    interrupted: KvdiagError | None = None
    started = time.monotonic()

    def progress(msg: str, _w: object) -> None:
        console.print(f"[dim]{time.monotonic() - started:6.1f}s[/dim] {msg}", highlight=False, markup=True)
        if on_event:
            on_event(msg)

    arts: RunArtifacts | None = None
    device: str | None = None
    try:
        with ProcessSet(grace_s=scenario.windows.kill_grace_s) as procs:
            procs.make_private_dir(raw_log_dir)  # raw logs are unredacted: never left behind

            def _final_logs() -> None:  # what engines printed until teardown, then no raw copy
                _copy_logs_redacted(raw_log_dir, bundle_dir, bundle)
                shutil.rmtree(raw_log_dir, ignore_errors=True)

            procs.on_teardown(_final_logs)
            device = scenario.device.name or run_device_name(procs.run_id)
            # Engines log into a private temp dir; the bundle gets redacted copies.
            run = ScenarioRun(scenario, raw_log_dir, procs, device, progress=lambda m, w: progress(_esc(m), w))
            try:
                result = run.run()
                when = scenario.capture.when
                targets = (result.stalled if when == "stall" else
                           [w for w in result.watches if w.proc.alive()] if when == "always" else [])
                if targets:
                    progress(f"capturing {', '.join(w.spec.name for w in targets)} "
                             f"({', '.join(scenario.capture.tools)})", None)
                    _capture_engines(targets, bundle_dir, list(scenario.capture.tools),
                                     scenario.capture.tool_timeout_s, bundle)
                    run.timeline.append(TimelineEvent(t=round(time.monotonic() - run.t0, 3),
                                                      event="capture finished"))
            except (Interrupted, KeyboardInterrupt) as exc:
                interrupted = exc if isinstance(exc, Interrupted) else Interrupted(str(exc) or "interrupted (Ctrl-C)")
                result = RunResult(run.watches, run.timeline, run.metrics, run.t0)
            _fill_bundle(bundle, result)
            _copy_logs_redacted(raw_log_dir, bundle_dir, bundle)
            if interrupted is None:
                # Verdict and report before teardown: the user gets them as soon as the
                # evidence is in, and stopping hung engines (grace period) adds no delay.
                verdict, by_engine = analyze_bundle(bundle)
                bundle.timeline.append(TimelineEvent(t=round(time.monotonic() - run.t0, 3), event="verdict",
                                                     detail=verdict.kind.value))
                arts = finish(out_dir, bundle, command, verdict=verdict, by_engine=by_engine)
                progress(f"verdict {verdict.kind.value}; stopping engines", None)
    except (Interrupted, KeyboardInterrupt) as exc:
        interrupted = exc if isinstance(exc, Interrupted) else Interrupted(str(exc) or "interrupted (Ctrl-C)")
    finally:
        if raw_log_dir.exists():  # teardown did not get to its hook: copy what is there
            _copy_logs_redacted(raw_log_dir, bundle_dir, bundle)
            shutil.rmtree(raw_log_dir, ignore_errors=True)
        if device is not None and scenario.device.name is None:
            # The modelled device was this run's own: drop its shared lock/accounting files.
            from kvdiag.sim.harness import remove_device_files

            remove_device_files(device)
    if interrupted is not None or arts is None:
        stop = interrupted or Interrupted("interrupted")
        bundle.interrupted = True
        verdict = Verdict(kind=VerdictKind.UNKNOWN, summary=f"run interrupted: {stop.message}",
                          confidence=Confidence.LOW)
        finish(out_dir, bundle, command, verdict=verdict, by_engine={}, exit_code=ExitCode.INTERRUPTED)
        console.print(f"interrupted; partial report written to {out_dir}")
        raise stop
    return arts


def _fill_bundle(bundle: Bundle, result: RunResult) -> None:
    """Engine records and timeline, taken while processes still exist (pids, exit codes)."""
    bundle.engines = [w.record(f"logs/{w.spec.name}.log") for w in result.watches]
    bundle.timeline = list(result.timeline)
    bundle.metrics = list(result.metrics)
    bundle.stall_detected = bool(result.stalled)
    for w in result.watches:
        if w.outcome is Outcome.STALLED and w.quiet_since_t is not None:
            bundle.timeline.append(TimelineEvent(t=round(w.quiet_since_t - result.t0, 3),
                                                 event="stall onset (last progress)", engine=w.spec.name))
    bundle.timeline.sort(key=lambda e: e.t)


def _esc(text: str) -> str:
    from rich.markup import escape

    return escape(text)
