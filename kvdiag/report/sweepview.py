"""The view a sweep's renderers read (:mod:`kvdiag.report.sweep`): the stored :class:`~kvdiag.model.sweep.SweepReport`
and, made once from it, each cell as shown (label, colour, hover text, link, where the rule or the banner
disagrees) and the phase diagram's panels. Nothing here judges: every outcome is the report's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvdiag.model.scalar import show_scalar
from kvdiag.model.sweep import Scalar, SweepCell, SweepReport

_HANG_COLOURS = {"gil_cycle": "#c62828", "decode_stall": "#ad1457", "lock_order_inversion": "#6a1b9a",
                 "lost_wakeup": "#4527a0", "blocked_ipc_read": "#d84315", "gil_held_blocked": "#b71c1c"}
_OUTCOME_COLOURS = {"healthy": "#2e7d32", "crash": "#6d4c41", "inconclusive": "#9e9e9e", "error": "#424242",
                    "pending": "#eeeeee"}


def show(v: Scalar | None) -> str:
    """A parameter's value as every sweep rendering writes it ("—": not set)."""
    return "—" if v is None else show_scalar(v)


def pct(p: float) -> str:
    v = p * 100
    return f"{v:.0f} %" if v == 0 or v >= 10 else f"{v:.1f} %"


def cell_colour(cell: SweepCell) -> str:
    """Colour by outcome and, for hangs, by the verdict kind seen most."""
    if cell.outcome in ("hang", "mixed"):
        kind = max(((k, n) for k, n in cell.kinds.items() if k in _HANG_COLOURS), key=lambda kn: kn[1],
                   default=("", 0))[0]
        colour = _HANG_COLOURS.get(kind, "#e53935")
        if cell.outcome == "mixed":
            return "#ef6c00"
        return colour
    return _OUTCOME_COLOURS.get(cell.outcome, "#9e9e9e")


def _label(cell: SweepCell) -> str:
    if cell.repeat > 1 or len(cell.runs) > 1:
        return f"{cell.hangs}/{len(cell.runs)}"
    return {"hang": "hang", "healthy": "ok", "crash": "crash", "error": "err", "inconclusive": "?",
            "pending": ""}.get(cell.outcome, cell.outcome)


def _disagrees(cell: SweepCell) -> list[str]:
    out: list[str] = []
    hung = cell.outcome == "hang"
    if cell.outcome in ("hang", "healthy"):
        if cell.rule_predicts_hang is not None and cell.rule_predicts_hang != hung:
            out.append("the rule gets this cell wrong")
        if cell.banner_predicts_hang is not None and cell.banner_predicts_hang != hung:
            out.append("the banner's static rule disagrees")
        if cell.banner_predicts_hang is None and hung:
            out.append("hung without a banner to judge")
    return out


def _title(cell: SweepCell, disagrees: list[str]) -> str:
    parts = [", ".join(f"{k}={show(v)}" for k, v in cell.params.items()),
             f"outcome: {cell.outcome} ({cell.hangs}/{len(cell.runs)} hung)"]
    if cell.kinds:
        parts.append("verdicts: " + ", ".join(f"{k}×{n}" for k, n in cell.kinds.items()))
    if cell.signatures:
        parts.append("signatures: " + ", ".join(cell.signatures))
    return "\n".join(parts + disagrees)


def order(v: Scalar | None) -> tuple[int, float, str]:
    """Booleans, then numbers by value, then words: how an axis's values are laid out."""
    if isinstance(v, bool):
        return (0, float(v), "")
    if isinstance(v, (int, float)):
        return (1, float(v), "")
    return (2, 0.0, str(v))


@dataclass(frozen=True)
class CellView:
    """One cell as shown: its label in the diagram, colour, hover text, the first run's report, and what
    disagrees with its outcome (the rule, the banner)."""

    cell: SweepCell
    label: str
    colour: str
    title: str
    link: str | None
    disagrees: list[str]


def cell_view(cell: SweepCell) -> CellView:
    disagrees = _disagrees(cell)
    link = f"{cell.runs[0].path}/report.html" if cell.runs and cell.runs[0].path else None
    return CellView(cell, _label(cell), cell_colour(cell), _title(cell, disagrees), link, disagrees)


@dataclass(frozen=True)
class Panel:
    """One grid of the phase diagram: x is the last axis, y the one before, the other axes fixed (``title``; empty
    for the one grid of a sweep of at most two axes; ``y_label`` empty for one axis).
    ``rows``: top row first, each its y value and one cell per x value (None: no such cell)."""

    title: str
    x_label: str
    y_label: str
    xs: list[str]
    rows: list[tuple[str, list[CellView | None]]]


def _panels(report: SweepReport, shown: dict[str, CellView]) -> list[Panel]:
    axes = report.axes
    if not axes or not report.cells:
        return []
    by_params = {tuple((k, show(v)) for k, v in c.params.items()): shown[c.key] for c in report.cells}
    x = axes[-1]
    y = axes[-2] if len(axes) >= 2 else None
    rest = axes[:-2] if len(axes) >= 2 else []
    xs = sorted({c.params.get(x.label) for c in report.cells}, key=order)
    ys = sorted({c.params.get(y.label) for c in report.cells}, key=order) if y else [None]
    panels: list[Panel] = []
    for combo in list(itertools.product(*(a.values for a in rest))) or [()]:
        fixed: dict[str, Scalar | None] = dict(zip([a.label for a in rest], combo, strict=True))
        rows: list[tuple[str, list[CellView | None]]] = []
        for yv in reversed(ys):
            cells: list[CellView | None] = []
            for xv in xs:
                params = dict(fixed)
                if y is not None:
                    params[y.label] = yv
                params[x.label] = xv
                cells.append(by_params.get(tuple((a.label, show(params.get(a.label))) for a in axes)))
            rows.append((show(yv) if y else "", cells))
        panels.append(Panel(title=", ".join(f"{k}={show(v)}" for k, v in fixed.items()),
                            x_label=x.label, y_label=y.label if y else "", xs=[show(v) for v in xs], rows=rows))
    return panels


@dataclass
class SweepView:
    """What every sweep renderer reads: the report, its cells as shown (in the table's order), the phase
    diagram's panels and its legend (word, colour)."""

    report: SweepReport
    cells: list[CellView] = field(default_factory=list)
    panels: list[Panel] = field(default_factory=list)
    legend: list[tuple[str, str]] = field(default_factory=list)


def sweep_view(report: SweepReport) -> SweepView:
    """The view of a sweep's stored report (built once per rendering)."""
    shown = {c.key: cell_view(c) for c in report.cells}
    labels = [a.label for a in report.axes]
    table = sorted(report.cells, key=lambda c: [order(c.params.get(lbl)) for lbl in labels])
    seen = sorted({(c.outcome, shown[c.key].colour, next(iter(c.kinds), "")) for c in report.cells})
    return SweepView(report=report, cells=[shown[c.key] for c in table], panels=_panels(report, shown),
                     legend=[(kind if outcome == "hang" else outcome, colour) for outcome, colour, kind in seen])
