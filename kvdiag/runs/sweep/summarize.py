"""From runs to cells, and from cells to the sweep's conclusions (rates, rule, banner check, A/B). Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvdiag.errors import ExitCode
from kvdiag.kvcached.banner import assess_risk_for
from kvdiag.model.kinds import VerdictKind
from kvdiag.model.report import Report
from kvdiag.model.run import BannerInfo, TimelineEvent
from kvdiag.model.scalar import show_scalar
from kvdiag.model.sweep import ABRates, RateLine, SweepCell, SweepReport, SweepRule, SweepRun
from kvdiag.runs.sweep.rates import clopper_pearson, distribution, rate_text
from kvdiag.runs.sweep.rule import banner_check, infer_rule, rule_predicts


def run_from_report(index: int, exit_code: int, report: Report | None, path: str, wall_s: float,
                    error: str | None = None) -> SweepRun:
    """One run's record from the exit status of its `repro` and the report.json it wrote."""
    if report is None:
        return SweepRun(index=index, outcome="error", exit_code=exit_code, verdict="none",
                        summary=error or f"the run exited {exit_code} without a report", wall_s=round(wall_s, 3),
                        path=path)
    v = report.verdict
    if v.kind.is_hang:
        outcome = "hang"
    elif v.kind is VerdictKind.HEALTHY and exit_code == ExitCode.OK:
        # slow_start (the window ran out while an engine still started) proves neither a hang nor health
        outcome = "healthy"
    elif v.kind in (VerdictKind.CRASH, VerdictKind.OOM):
        outcome = "crash"
    elif exit_code in (ExitCode.FAILED, ExitCode.USAGE):
        outcome = "error"
    else:
        outcome = "inconclusive"
    # The static rule on every banner the engines printed, judged here for each engine's allocator (the
    # same function the run's own banner check uses), so the check holds whatever the run stored.
    printed: list[tuple[BannerInfo, str | None]] = []
    for e in report.engines:
        printed += [(b, e.allocator) for b in e.banners] or ([(e.banner, e.allocator)] if e.banner else [])
    risks = [assess_risk_for(b, allocator) for b, allocator in printed]
    reasons = [r for risk in risks for r in risk.reasons if risk.risky]
    return SweepRun(
        index=index, outcome=outcome, exit_code=exit_code, verdict=v.kind.value, signature=v.signature,
        engine=v.engine, summary=v.summary[:400],
        time_to_hang_s=_time_to_hang(report.timeline, v.engine) if outcome == "hang" else None,
        time_to_healthy_s=_time_to_healthy(report) if outcome == "healthy" else None,
        banner_risk=any(r.risky for r in risks) if risks else None, banner_reasons=reasons[:4],
        wall_s=round(wall_s, 3), path=path)


def _time_to_hang(timeline: Sequence[TimelineEvent], engine: str | None) -> float | None:
    """The hung engine's last progress, counted from its launch."""
    launched = next((e.t for e in timeline if e.event == "launched" and e.engine == engine), None)
    onset = next((e.t for e in timeline if e.event.startswith("stall onset") and e.engine == engine), None)
    if launched is None or onset is None:
        return None
    return round(max(0.0, onset - launched), 3)


def _time_to_healthy(report: Report) -> float | None:
    """First launch → the last engine ready."""
    launches = [e.t for e in report.timeline if e.event == "launched"]
    ready = [e.t for e in report.timeline if e.event == "ready"]
    if not launches or not ready or len(ready) < len(report.engines):
        return None
    return round(max(ready) - min(launches), 3)


def summarize_cell(cell: SweepCell) -> SweepCell:
    """Rates, interval, kinds, signatures and distributions of a cell from its runs."""
    runs = sorted(cell.runs, key=lambda r: r.index)
    n = len(runs)
    hangs = sum(1 for r in runs if r.outcome == "hang")
    healthy = sum(1 for r in runs if r.outcome == "healthy")
    if n == 0:
        outcome = "pending"
    elif hangs == n:
        outcome = "hang"
    elif hangs:
        outcome = "mixed"
    elif healthy == n:
        outcome = "healthy"
    elif any(r.outcome == "error" for r in runs):
        outcome = "error"
    elif any(r.outcome == "crash" for r in runs):
        outcome = "crash"
    else:
        outcome = "inconclusive"
    banner = next((r.banner_risk for r in runs if r.banner_risk is not None), None)
    return cell.model_copy(update={
        "runs": runs, "outcome": outcome, "hangs": hangs,
        "interval": clopper_pearson(hangs, n) if n else None,
        "kinds": dict(Counter(r.verdict for r in runs)),
        "signatures": dict(Counter(r.signature for r in runs if r.signature)),
        "time_to_hang": distribution([r.time_to_hang_s for r in runs if r.time_to_hang_s is not None]),
        "time_to_healthy": distribution([r.time_to_healthy_s for r in runs if r.time_to_healthy_s is not None]),
        "banner_predicts_hang": banner,
    })


def conclude(report: SweepReport) -> SweepReport:
    """Rule, banner check, A/B rates, exit code and summary from the report's cells."""
    cells = [summarize_cell(c) for c in report.cells]
    rule = infer_rule(cells)
    planned = max(report.cells_planned, len(cells))
    not_run = [c.key for c in cells if c.outcome == "pending"]
    unrun = planned - (len(cells) - len(not_run))
    partial = report.interrupted and unrun > 0
    if partial:
        # A rule fitted on the cells that ran says nothing of those that did not (the hanging one may be
        # among them): no rule, and the cells left are named.
        left = f" ({', '.join(not_run[:5])}{', ...' if len(not_run) > 5 else ''})" if not_run else ""
        rule = SweepRule(text=f"no rule from a partial grid: {unrun} of {planned} cell(s) did not run{left}; "
                              "continue with --resume", fits=False, mixed=rule.mixed)
    predicted = {} if partial else rule_predicts(cells, rule)
    cells = [c.model_copy(update={"rule_predicts_hang": predicted.get(c.key)}) for c in cells]
    check = banner_check(cells)
    hung = [c for c in cells if c.hangs]
    errors = [c for c in cells if c.outcome == "error"]
    undecided = [c for c in cells if c.outcome in ("crash", "inconclusive")]
    if report.interrupted:
        code = ExitCode.INTERRUPTED
    elif hung:
        code = ExitCode.DEADLOCK
    elif errors:
        code = ExitCode.FAILED
    else:
        code = ExitCode.OK
    done = [c for c in cells if c.outcome != "pending"]
    runs = sum(len(c.runs) for c in cells)
    summary = (f"{len(done)} cell(s) of {max(report.cells_planned, len(done))}, {runs} run(s): "
               f"{len(hung)} cell(s) hung, {sum(1 for c in cells if c.outcome == 'healthy')} healthy"
               + (f", {len(errors)} failed to run" if errors else "")
               + (f", {len(undecided)} neither (left out of the rule: {', '.join(c.key for c in undecided[:5])})"
                  if undecided else "")
               + ("; interrupted" if report.interrupted else "") + f". {rule.text}")
    ab = _ab_rates(cells) if report.command.startswith("ab") else None
    boundaries = _boundaries(report, cells)
    if ab is not None:
        summary = ab.text + ("; interrupted" if report.interrupted else "")
        if not report.interrupted:
            code = ExitCode.OK if ab.separated else ExitCode.FAILED
    return report.model_copy(update={"cells": cells, "rule": rule, "banner_check": check, "ab": ab,
                                     "boundaries": boundaries,
                                     "exit_code": code, "summary": summary})


def _boundaries(report: SweepReport, cells: Sequence[SweepCell]) -> list[str]:
    """For a bisected axis: per setting of the other axes, the last value on one side of the change and
    the first on the other (read from the cells, so it holds for what actually ran)."""
    axis = next((a for a in report.axes if a.bisect), None)
    if axis is None:
        return []
    lines: dict[tuple[tuple[str, str], ...], list[SweepCell]] = {}
    for c in cells:
        if c.outcome == "pending":
            continue
        other = tuple((k, show_scalar(v)) for k, v in c.params.items() if k != axis.label)
        lines.setdefault(other, []).append(c)
    out: list[str] = []
    for other, members in lines.items():
        members.sort(key=lambda c: float(c.params[axis.label]))
        where = ", ".join(f"{k}={v}" for k, v in other) or "all cells"
        changes = [(a, b) for a, b in zip(members, members[1:], strict=False) if a.outcome != b.outcome]
        if not changes:
            out.append(f"{where}: {members[0].outcome} from {axis.label}={show_scalar(members[0].params[axis.label])} "
                       f"to {show_scalar(members[-1].params[axis.label])} (no change)")
            continue
        a, b = changes[0]
        out.append(f"{where}: {a.outcome} at {axis.label}={show_scalar(a.params[axis.label])}, "
                   f"{b.outcome} at {show_scalar(b.params[axis.label])}"
                   + (f" ({len(changes)} changes along the line)" if len(changes) > 1 else ""))
    return out


def _line(label: str, cells: Sequence[SweepCell]) -> RateLine:
    runs = [r for c in cells for r in c.runs]
    k = sum(1 for r in runs if r.outcome == "hang")
    iv = clopper_pearson(k, len(runs))
    return RateLine(label=label, runs=len(runs), hangs=k, healthy=sum(1 for r in runs if r.outcome == "healthy"),
                    interval=iv, text=rate_text(label, k, len(runs), iv))


def _ab_rates(cells: Sequence[SweepCell]) -> ABRates | None:
    """`ab --repeat`: the cells are the two allocators."""
    by = {str(c.params.get("allocator")): c for c in cells}
    if "stock" not in by or "fixed" not in by:
        return None
    stock, fixed = _line("stock", [by["stock"]]), _line("fixed", [by["fixed"]])
    separated = (fixed.runs > 0 and fixed.healthy == fixed.runs and stock.hangs > 0)
    disjoint = stock.interval.low > fixed.interval.high
    verdict = ("the fix holds: every fixed run started healthy while the stock allocator hung"
               if separated else "the A/B did not separate")
    text = (f"{stock.text}; {fixed.text}: {verdict}"
            + ("; the 95 % intervals do not overlap" if disjoint else
               "; the 95 % intervals overlap (more repeats narrow them)"))
    return ABRates(stock=stock, fixed=fixed, separated=separated, intervals_disjoint=disjoint, text=text)
