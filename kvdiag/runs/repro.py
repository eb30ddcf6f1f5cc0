"""What `kvdiag repro`, `ab` and `sweep` check before any folder or engine exists: the scenario loads,
its engines can be launched here, and (ab, an allocator axis) its allocator can be switched."""

from __future__ import annotations

from pathlib import Path

from kvdiag.launch.preflight import check_launchable
from kvdiag.runs.lifecycle import switchable
from kvdiag.scenario import Scenario, load_scenario


def launchable(path: Path | None, switching: str | None = None) -> tuple[Scenario, str, str]:
    """The scenario at ``path`` (None: the embedded default) as (scenario, name, text), refused before
    anything starts when it cannot run here; ``switching``: the command that switches its allocator."""
    scen, name, text = load_scenario(path)
    check_launchable(scen, name, text)
    if switching is not None:
        switchable(scen, switching)
    return scen, name, text
