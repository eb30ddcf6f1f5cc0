"""`kvdiag ab`: the same scenario with the stock and the fixed allocator, side by side."""

from __future__ import annotations

import copy
from pathlib import Path

import typer

from kvdiag.cli.common import console
from kvdiag.errors import ExitCode
from kvdiag.model import Confidence, Verdict, VerdictKind
from kvdiag.runner import RunArtifacts, finish, new_bundle, prepare_out_dir, run_scenario
from kvdiag.scenario import load_scenario


def _side(arts: RunArtifacts, base: Path) -> dict[str, object]:
    return {"verdict": arts.verdict.kind.value, "summary": arts.verdict.summary, "exit_code": arts.exit_code,
            "report": str(arts.out_dir.relative_to(base) / "report.html"),
            "engines": {e.name: {"phase": e.phase.value, "healthy": e.healthy, "startup_s": e.startup_s}
                        for e in arts.bundle.engines}}


def ab_cmd(
    scenario: Path | None = typer.Option(None, "--scenario", "-s",
                                         help="Scenario YAML (default: embedded two-engine)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: reports/ab-<timestamp>)."),
) -> int:
    """Run a scenario with the stock and with the fixed allocator; compare both runs.

    Each side is a full run with its own report: OUT/stock/ and OUT/fixed/.
    OUT/report.html puts the two side by side, with links to each.
    Exit codes: 0 fixed healthy and stock reproduced the hang,
    1 the A/B did not separate, 2 bad usage, 130 interrupted.
    """
    scen, name, text = load_scenario(scenario)
    out_dir = prepare_out_dir(out, "ab")
    con = console()
    sides: dict[str, RunArtifacts] = {}
    for allocator in ("stock", "fixed"):
        con.rule(f"{allocator} allocator")
        sub = prepare_out_dir(out_dir / allocator, f"ab {allocator}")
        sides[allocator] = run_scenario(copy.deepcopy(scen), name, text, sub, f"ab ({allocator})", con,
                                        allocator=allocator)
        con.print(f"{allocator}: {sides[allocator].verdict.kind.value} — {sides[allocator].verdict.summary}")
    stock, fixed = sides["stock"], sides["fixed"]
    reproduced = stock.verdict.kind.is_hang
    fixed_ok = fixed.verdict.kind is VerdictKind.HEALTHY
    ok = reproduced and fixed_ok
    summary = (f"stock: {stock.verdict.kind.value}; fixed: {fixed.verdict.kind.value} — "
               + ("the fixed allocator removes the hang the stock one reproduces" if ok
                  else "A/B did not separate: "
                  + ("stock did not reproduce" if not reproduced else "fixed is not healthy")))
    bundle = new_bundle("ab")
    bundle.scenario_path = name
    bundle.engines = [e.model_copy(update={"name": f"{side}/{e.name}"})
                      for side, arts in sides.items() for e in arts.bundle.engines]
    bundle.findings = [f for arts in sides.values() for f in arts.bundle.findings]
    verdict = Verdict(kind=stock.verdict.kind if reproduced else fixed.verdict.kind, summary=summary,
                      confidence=Confidence.HIGH if ok else Confidence.MEDIUM,
                      evidence=stock.verdict.evidence, cycle=stock.verdict.cycle)
    code = ExitCode.OK if ok else ExitCode.FAILED
    ab = {"stock": _side(stock, out_dir), "fixed": _side(fixed, out_dir), "separated": ok}
    finish(out_dir, bundle, "ab", ab=ab, verdict=verdict,
           by_engine={"stock": stock.verdict, "fixed": fixed.verdict,
                      **{f"{side}/{name}": v for side, arts in sides.items()
                         for name, v in arts.verdicts_by_engine.items()}}, exit_code=code)
    con.print(summary)
    con.print(f"  report: {out_dir / 'report.html'}")
    con.print(f"exit code {code}")
    return code


def register(app: typer.Typer) -> None:
    app.command("ab")(ab_cmd)
