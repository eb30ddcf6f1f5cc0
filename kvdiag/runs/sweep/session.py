"""One sweep end to end: check the folder (resume), plan, run the cells, conclude, write the reports."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdiag import __version__
from kvdiag.bundle.io import atomic_write_text
from kvdiag.errors import UsageError
from kvdiag.model.sweep import SweepReport
from kvdiag.report.sweep import SWEEP_RENDERERS, render_sweep_html
from kvdiag.report.sweepview import sweep_view
from kvdiag.runs.sweep.axes import Axis, cell_scenario, parse_vary, unique_labels
from kvdiag.runs.sweep.execute import RUN_SLACK_S, CellSpec, Progress, SweepExecutor, SweepStore
from kvdiag.runs.sweep.plan import Params, SweepPlan, cell_key
from kvdiag.runs.sweep.rule import cell_features
from kvdiag.runs.sweep.summarize import conclude
from kvdiag.scenario.models import Scenario

PLAN_FILE = "sweep.json"


@dataclass
class SweepConfig:
    scenario: Scenario
    scenario_name: str
    scenario_text: str
    out_dir: Path
    vary: list[str]
    bisect: str | None = None
    engines: list[str] | None = None        # start only these engines (None: all)
    repeat: int = 1
    jobs: int = 1
    stall_window_s: float | None = None     # None: the scenario's own
    command: str = "sweep"
    extra_axes: list[Axis] = field(default_factory=list)

    def identity(self) -> dict[str, object]:
        """What makes two invocations the same sweep (so the second continues the first)."""
        return {"command": self.command, "vary": list(self.vary), "bisect": self.bisect, "repeat": self.repeat,
                "engines": self.engines,
                "stall_window_s": self.stall_window_s, "scenario": self.scenario_name,
                "scenario_sha256": hashlib.sha256(self.scenario_text.encode()).hexdigest()}


def stored_identity(out_dir: Path) -> dict[str, Any] | None:
    """The sweep a folder holds (None: not a sweep folder)."""
    try:
        data = json.loads((out_dir / PLAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def only_engines(scenario: Scenario, names: list[str] | None) -> Scenario:
    """The scenario with only the named engines (a dependency on a left-out engine is dropped)."""
    out = scenario.model_copy(deep=True)
    if not names:
        return out
    known = [e.name for e in scenario.engines]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"--engines: no engine named {unknown[0]!r} in the scenario",
                         hint=f"engines: {', '.join(known)}")
    out.engines = [e for e in out.engines if e.name in names]
    for e in out.engines:
        if e.start_after is not None and e.start_after not in names:
            e.start_after = None
    return out


def build_axes(cfg: SweepConfig, scenario: Scenario) -> list[Axis]:
    axes = [parse_vary(v, scenario) for v in cfg.vary] + list(cfg.extra_axes)
    if cfg.bisect:
        axes.append(parse_vary(cfg.bisect, scenario, bisect=True))
    if not axes:
        raise UsageError("nothing to vary", hint="give --vary FIELD=VALUES (e.g. "
                                                 "--vary engines.vlm.sim.min_reserved_pages=1..10)")
    unique_labels(axes)
    return axes


def run_sweep(cfg: SweepConfig, progress: Progress) -> SweepReport:
    """Run (or continue) the sweep in ``cfg.out_dir``; writes report.json and report.html there."""
    base = only_engines(cfg.scenario, cfg.engines)
    axes = build_axes(cfg, base)
    if cfg.stall_window_s is not None:
        base.windows.stall_s = cfg.stall_window_s
    plan = SweepPlan(axes)

    def make_cell(params: Params) -> CellSpec:
        cell = cell_scenario(base, axes, params)
        return CellSpec(cell_key(params), params, cell.scenario, cell_features(cell.scenario, params), cell.notes)

    # Every cell's scenario is built before anything runs: an invalid value stops the sweep at once.
    if plan.bisect_axis is None:
        for params in SweepPlan(axes).take():
            make_cell(params)
    _check_folder(cfg)
    store = SweepStore(cfg.out_dir)
    executor = SweepExecutor(plan, make_cell, store, repeat=cfg.repeat, jobs=cfg.jobs, progress=progress,
                             run_timeout_s=base.windows.timeout_s + RUN_SLACK_S,
                             confirm_stall_s=(cfg.scenario.windows.stall_s
                                              if cfg.scenario.windows.stall_s > base.windows.stall_s else None))
    started = time.monotonic()
    progress(f"{cfg.command}: {plan.planned()} cell(s) x {cfg.repeat} run(s), {cfg.jobs} at a time, "
             f"stall window {base.windows.stall_s:g}s; output {cfg.out_dir}")
    interrupted = executor.run()
    if executor.resumed_cells:
        progress(f"{executor.resumed_cells} cell(s) were already finished in {cfg.out_dir} (resumed)")
    report = SweepReport(
        kvdiag_version=__version__, command=cfg.command,
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        scenario=cfg.scenario_name, axes=[a.model() for a in axes], repeat=cfg.repeat, jobs=cfg.jobs,
        engines_left_out=[e.name for e in cfg.scenario.engines if e.name not in {x.name for x in base.engines}],
        stall_window_s=base.windows.stall_s, cells=list(executor.cells.values()),
        cells_planned=max(plan.planned(), len(executor.cells)), finished=not interrupted,
        interrupted=interrupted, wall_s=round(time.monotonic() - started, 1))
    report = conclude(report)
    write_reports(cfg.out_dir, report)
    return report


def _check_folder(cfg: SweepConfig) -> None:
    """A folder holding another sweep is refused; the same sweep continues; a new one is recorded."""
    try:
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot write output folder {cfg.out_dir}: {exc.strerror or exc}",
                         hint="pass --out DIR pointing at a writable folder") from None
    stored = stored_identity(cfg.out_dir)
    mine = cfg.identity()
    if stored is not None and stored != mine:
        diff = sorted(k for k in set(stored) | set(mine) if stored.get(k) != mine.get(k))
        raise UsageError(f"{cfg.out_dir} holds a different sweep (differs in: {', '.join(diff)})",
                         hint="use another --out, or --resume with only --out to continue the sweep stored there")
    if stored is None:
        try:
            atomic_write_text(cfg.out_dir / PLAN_FILE, json.dumps(mine, indent=1) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write output folder {cfg.out_dir}: {exc.strerror or exc}",
                             hint="pass --out DIR pointing at a writable folder") from None


def write_reports(out_dir: Path, report: SweepReport) -> dict[str, Path]:
    view = sweep_view(report)
    paths = {name: out_dir / name for name in SWEEP_RENDERERS}
    for name, render in SWEEP_RENDERERS.items():   # report.json first: it is the contract
        atomic_write_text(paths[name], render(view))
    return paths


def is_sweep_folder(path: Path) -> bool:
    return path.is_dir() and (path / PLAN_FILE).is_file() and (path / "report.json").is_file()


def rerender_sweep(folder: Path, html: Path | None, out: Path | None) -> dict[str, Path]:
    """`kvdiag report SWEEP_FOLDER`: the HTML again from the stored report.json (nothing re-judged)."""
    try:
        report = SweepReport.model_validate_json((folder / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{folder}: unreadable sweep report.json: {exc}") from None
    target = html if html is not None else (out or folder) / "report.html"
    try:
        atomic_write_text(target, render_sweep_html(sweep_view(report)))
    except OSError as exc:
        raise UsageError(f"cannot write the report: {exc.strerror or exc}",
                         hint="pass --out DIR or --html FILE pointing at a writable place") from None
    return {"report.html": target}

