"""`kvdiag repro two-engine`: run a co-location scenario end to end."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from kvdiag.cli.common import console, print_outcome
from kvdiag.runs.outdir import prepare_out_dir
from kvdiag.runs.repro import launchable, run_scenario


class AllocatorChoice(str, Enum):
    stock = "stock"
    fixed = "fixed"


repro_app = typer.Typer(help="Reproduce a hang from a scenario.", no_args_is_help=True)


@repro_app.command("two-engine")
def two_engine(
    scenario: Path | None = typer.Option(None, "--scenario", "-s", help="Scenario YAML (default: embedded "
                                         "two simulated engines with kvcached #371's parameters, no GPU)."),
    allocator: AllocatorChoice | None = typer.Option(None, "--allocator", help="Override the allocator of "
                                                     "every simulated engine."),
    out: Path | None = typer.Option(None, "--out", "-o",
                                    help="Output folder (default: reports/repro-two-engine-<timestamp>)."),
) -> int:
    """Run co-located engines from a scenario; capture and diagnose the one that hangs.

    Exit codes: 0 all engines healthy, 10 deadlock or stall, 4 an engine failed,
    6 inconclusive (the evidence that decides is missing, named), 2 bad usage or
    scenario, 130 interrupted.
    """
    # Refused before any folder or engine exists.
    scen, name, text = launchable(scenario, f"--allocator {allocator.value}" if allocator is not None else None)
    out_dir = prepare_out_dir(out, "repro two-engine")
    con = console()
    con.print(f"kvdiag repro two-engine: scenario {name}, output {out_dir}")
    arts = run_scenario(scen, name, text, out_dir, "repro two-engine", con,
                        allocator=allocator.value if allocator else None)
    return print_outcome(arts)


def register(app: typer.Typer) -> None:
    app.add_typer(repro_app, name="repro")
