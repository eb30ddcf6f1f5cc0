"""`kvdiag sweep`'s and `kvdiag ab --repeat`'s configurations: the options (or the stored sweep that
--resume continues) resolved into a :class:`~kvdiag.runs.sweep.session.SweepConfig`."""

from __future__ import annotations

import os
from pathlib import Path

from kvdiag import defaults as D
from kvdiag.errors import UsageError
from kvdiag.runs.outdir import default_out_dir
from kvdiag.runs.repro import launchable
from kvdiag.runs.sweep.session import SweepConfig, stored_identity
from kvdiag.scenario.models import Scenario


def default_jobs() -> int:
    """One run more than CPUs: a hung run spends its stall window idle (benchmarks/results/sweep_jobs.txt)."""
    return max(1, min((os.cpu_count() or 1) + 1, D.SWEEP_MAX_JOBS))


def sweep_config(*, vary: list[str], bisect: str | None, scenario: Path | None, repeat: int, jobs: int,
                 out: Path | None, resume: bool, engines: str | None, stall_window: float | None) -> SweepConfig:
    """The sweep the options ask for; with --resume and no --vary/--bisect, the one stored in --out."""
    if resume and out is None:
        raise UsageError("--resume needs --out DIR (the folder of the sweep to continue)")
    if resume and not vary and bisect is None:
        if out is None:
            raise UsageError("--resume needs --out DIR")
        stored = stored_identity(out)
        if stored is None or stored.get("command") != "sweep":
            raise UsageError(f"{out} holds no sweep to resume", hint="start one with --vary FIELD=VALUES --out DIR")
        vary = [str(v) for v in stored.get("vary") or []]
        bisect = stored.get("bisect") if isinstance(stored.get("bisect"), str) else None
        repeat = int(stored.get("repeat") or 1)
        window = stored.get("stall_window_s")
        stall_window = float(window) if isinstance(window, (int, float)) else None
        name = str(stored.get("scenario") or "")
        kept = stored.get("engines")
        engines = ",".join(str(e) for e in kept) if isinstance(kept, list) else None
        scenario = None if name.startswith("<builtin>") else Path(name)
    elif not vary and bisect is None:
        raise UsageError("nothing to vary", hint="give --vary FIELD=VALUES, e.g. "
                                                 "--vary engines.vlm.sim.min_reserved_pages=1..10")
    # Once, before any cell: not the same refusal in every run.
    switching = any(v.split("=", 1)[0].strip() == "allocator" for v in vary)
    scen, name, text = launchable(scenario, "kvdiag sweep --vary allocator=..." if switching else None)
    if stall_window is None:
        stall_window = min(D.SWEEP_STALL_WINDOW_S, scen.windows.stall_s)
    out_dir = out if out is not None else default_out_dir("sweep")
    return SweepConfig(scenario=scen, scenario_name=name, scenario_text=text, out_dir=out_dir, vary=list(vary),
                       bisect=bisect, repeat=repeat,
                       engines=[e.strip() for e in engines.split(",") if e.strip()] if engines else None,
                       jobs=jobs or default_jobs(), stall_window_s=stall_window)


def ab_repeat_config(scen: Scenario, name: str, text: str, out: Path | None, repeat: int, jobs: int) -> SweepConfig:
    """`kvdiag ab --repeat N`: a sweep over allocator=stock,fixed, N runs each, judged as an A/B (the caller
    has refused scenarios whose allocator kvdiag cannot switch)."""
    out_dir = out if out is not None else default_out_dir("ab")
    return SweepConfig(scenario=scen, scenario_name=name, scenario_text=text, out_dir=out_dir,
                       vary=["allocator=stock,fixed"], repeat=repeat, jobs=jobs or default_jobs(), command="ab")
