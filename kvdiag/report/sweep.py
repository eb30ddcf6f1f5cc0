"""Render a sweep's report (kvdiag.model.SweepReport): one self-contained HTML file (table and phase
diagram, no network, every text escaped) and the terminal summary. Renders only what the report holds."""

from __future__ import annotations

import html
import itertools
from collections.abc import Sequence

from kvdiag.model import Scalar, SweepCell, SweepReport
from kvdiag.model.scalar import show_scalar

_HANG_COLOURS = {"gil_cycle": "#c62828", "decode_stall": "#ad1457", "lock_order_inversion": "#6a1b9a",
                 "lost_wakeup": "#4527a0", "blocked_ipc_read": "#d84315", "gil_held_blocked": "#b71c1c"}
_OUTCOME_COLOURS = {"healthy": "#2e7d32", "crash": "#6d4c41", "inconclusive": "#9e9e9e", "error": "#424242",
                    "pending": "#eeeeee"}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#222}
main{margin:1.5em;max-width:1400px}
header.top{background:#24292f;color:#f0f3f6;padding:10px 20px;font-size:13px}
header.top b{color:#fff}header.top span{margin-right:18px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
.rule{font-size:1.15em;padding:.6em .8em;background:#f3f6fa;border-left:4px solid #1565c0}
.bad{border-left-color:#c62828}.note{color:#555;font-size:.9em}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left}
th{background:#f5f5f5}tr.hang td.o{color:#c62828;font-weight:600}tr.healthy td.o{color:#2e7d32}
.panel{display:inline-block;vertical-align:top;margin:0 1.5em 1.5em 0}
.grid{display:grid;gap:2px;align-items:stretch}
.c{min-width:4.5em;min-height:2.6em;display:flex;align-items:center;justify-content:center;color:#fff;
   font-size:.9em;border-radius:3px;text-decoration:none;position:relative}
.c.off{outline:3px solid #ffb300;outline-offset:-3px}
.ax{font-size:.85em;color:#333;display:flex;align-items:center;justify-content:center;padding:0 .4em}
.legend span{display:inline-block;padding:.1em .5em;margin:.1em;color:#fff;border-radius:2px;font-size:.8em}
code{background:#f4f4f4;padding:0 .2em}
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _show(v: Scalar | None) -> str:
    return "—" if v is None else show_scalar(v)


def _pct(p: float) -> str:
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


def _cell_label(cell: SweepCell) -> str:
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


def _title(cell: SweepCell) -> str:
    parts = [", ".join(f"{k}={_show(v)}" for k, v in cell.params.items()),
             f"outcome: {cell.outcome} ({cell.hangs}/{len(cell.runs)} hung)"]
    if cell.kinds:
        parts.append("verdicts: " + ", ".join(f"{k}×{n}" for k, n in cell.kinds.items()))
    if cell.signatures:
        parts.append("signatures: " + ", ".join(cell.signatures))
    parts += _disagrees(cell)
    return "\n".join(parts)


def _link(cell: SweepCell) -> str | None:
    return f"{cell.runs[0].path}/report.html" if cell.runs and cell.runs[0].path else None


def _phase_panels(report: SweepReport) -> str:
    """One CSS grid per setting of the axes beyond the first two: x = the last axis, y = the one before."""
    axes = report.axes
    if not axes or not report.cells:
        return "<p>no cells</p>"
    by_params = {tuple((k, _show(v)) for k, v in c.params.items()): c for c in report.cells}
    x = axes[-1]
    y = axes[-2] if len(axes) >= 2 else None
    rest = axes[:-2] if len(axes) >= 2 else []
    xs = sorted({c.params.get(x.label) for c in report.cells}, key=_order)
    ys = sorted({c.params.get(y.label) for c in report.cells}, key=_order) if y else [None]
    out: list[str] = []
    combos = list(itertools.product(*(a.values for a in rest))) or [()]
    for combo in combos:
        fixed = dict(zip([a.label for a in rest], combo, strict=True))
        title = ", ".join(f"{k}={_show(v)}" for k, v in fixed.items()) or "all cells"
        rows: list[str] = []
        for yv in reversed(ys):
            rows.append(f'<div class="ax">{_e(_show(yv)) if y else ""}</div>')
            for xv in xs:
                params = dict(fixed)
                if y is not None:
                    params[y.label] = yv  # type: ignore[assignment]
                params[x.label] = xv  # type: ignore[assignment]
                key = tuple((a.label, _show(params.get(a.label))) for a in axes)
                cell = by_params.get(key)
                if cell is None:
                    rows.append('<div class="c" style="background:#f5f5f5"></div>')
                    continue
                off = " off" if _disagrees(cell) else ""
                link = _link(cell)
                tag = "a" if link else "div"
                href = f' href="{_e(link)}"' if link else ""
                mark = "!" if off else ""
                rows.append(f'<{tag} class="c{off}"{href} style="background:{cell_colour(cell)}" '
                            f'title="{_e(_title(cell))}">{_e(_cell_label(cell))}{mark}</{tag}>')
        rows.append('<div class="ax"></div>' + "".join(f'<div class="ax">{_e(_show(v))}</div>' for v in xs))
        grid = (f'<div class="grid" style="grid-template-columns:auto repeat({len(xs)},minmax(4.5em,auto))">'
                + "".join(rows) + "</div>")
        # A one-axis grid has no rows to name, and a single panel no title ("all cells", "rows ↑" read as noise).
        head = (f'<div class="note">{_e(title)}</div>' if rest else "") + (
            f'<div class="note">rows ↑ {_e(y.label)}</div>' if y else "")
        out.append(f'<div class="panel">{head}{grid}'
                   f'<div class="note">columns → {_e(x.label)}</div></div>')
    return "".join(out)


def _order(v: Scalar | None) -> tuple[int, float, str]:
    if isinstance(v, bool):
        return (0, float(v), "")
    if isinstance(v, (int, float)):
        return (1, float(v), "")
    return (2, 0.0, str(v))


def _legend(cells: Sequence[SweepCell]) -> str:
    seen = {(c.outcome, cell_colour(c), next(iter(c.kinds), "")) for c in cells}
    items = sorted(seen)
    spans = "".join(f'<span style="background:{col}">{_e(kind if out == "hang" else out)}</span>'
                    for out, col, kind in items)
    return (f'<p class="legend">{spans} <span style="background:#fff;color:#222;outline:3px solid #ffb300">'
            f'! rule or banner disagrees</span></p>')


def _table(report: SweepReport) -> str:
    labels = [a.label for a in report.axes]
    head = "".join(f"<th>{_e(lbl)}</th>" for lbl in labels)
    head += ("<th>outcome</th><th>hung</th><th>95 % CI</th><th>verdicts</th><th>signature</th>"
             "<th>time to hang (median, max)</th><th>time to healthy (median, max)</th><th>banner</th>"
             "<th>rule</th><th>runs</th>")
    rows: list[str] = []
    for c in sorted(report.cells, key=lambda c: [_order(c.params.get(lbl)) for lbl in labels]):
        iv = f"{_pct(c.interval.low)}–{_pct(c.interval.high)}" if c.interval else "—"
        tth = f"{c.time_to_hang.median:.2f}s, {c.time_to_hang.max:.2f}s" if c.time_to_hang else "—"
        tok = f"{c.time_to_healthy.median:.2f}s, {c.time_to_healthy.max:.2f}s" if c.time_to_healthy else "—"
        banner = {True: "risk", False: "no risk", None: "—"}[c.banner_predicts_hang]
        rule = {True: "hang", False: "no hang", None: "—"}[c.rule_predicts_hang]
        links = " ".join(f'<a href="{_e(r.path)}/report.html">{r.index + 1}</a>' for r in c.runs if r.path)
        notes = f'<div class="note">{_e("; ".join(c.notes))}</div>' if c.notes else ""
        rows.append(
            f'<tr class="{_e(c.outcome)}">' + "".join(f"<td>{_e(_show(c.params.get(lbl)))}</td>" for lbl in labels)
            + f'<td class="o">{_e(c.outcome)}{notes}</td><td>{c.hangs}/{len(c.runs)}</td><td>{_e(iv)}</td>'
            f'<td>{_e(", ".join(f"{k}×{n}" for k, n in c.kinds.items()))}</td>'
            f'<td>{_e(", ".join(c.signatures) or "—")}</td><td>{_e(tth)}</td><td>{_e(tok)}</td>'
            f'<td>{_e(banner)}</td><td>{_e(rule)}</td><td>{links}</td></tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def render_sweep_html(report: SweepReport) -> str:
    rule = report.rule
    check = report.banner_check
    # The same header bar as every run report: version, command, when, and the exit code first.
    bar = (f'<header class="top"><span><b>kvdiag</b> {_e(report.kvdiag_version)}</span>'
           f'<span>command: <b>{_e(report.command)}</b></span><span>created: {_e(report.created_at or "—")}</span>'
           f'<span>exit code: <b>{report.exit_code if report.exit_code is not None else "—"}</b></span>'
           f'<span>scenario: {_e(report.scenario)}</span>'
           f'{"<span><b>interrupted</b></span>" if report.interrupted else ""}</header><main>')
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8>"
             f"<title>kvdiag {_e(report.command)}: {_e(report.scenario)}</title><style>{_CSS}</style></head><body>",
             bar,
             f"<h1>kvdiag {_e(report.command)} — {_e(report.scenario)}</h1>"]
    if report.ab is None or report.ab.text != report.summary:   # ab's sentence is its summary: said once
        parts.append(f"<p>{_e(report.summary)}</p>")
    if report.ab is not None:
        parts.append(f'<p class="rule{"" if report.ab.separated else " bad"}">{_e(report.ab.text)}</p>')
    if rule is not None:
        ctx = f"; in every cell: {', '.join(rule.context)}" if rule.context else ""
        parts.append(f'<h2>Boundary</h2><p class="rule{"" if rule.fits else " bad"}">{_e(rule.text)}{_e(ctx)}</p>')
        notes: list[str] = []
        if rule.fits:
            notes.append(f"fits all {rule.decided} cell(s) that always or never hung")
        else:
            notes.append(f"gets {len(rule.wrong)} of {rule.decided} cell(s) wrong: {', '.join(rule.wrong[:10])}")
        if rule.mixed:
            notes.append(f"{len(rule.mixed)} cell(s) hung in some runs only (left out of the fit): "
                         f"{', '.join(rule.mixed[:10])}")
        if rule.alternatives:
            notes.append("also consistent with these cells: " + "; ".join(rule.alternatives))
        parts.append("".join(f'<p class="note">{_e(n)}</p>' for n in notes))
    if report.boundaries:
        parts.append("<h2>Boundary along the bisected axis</h2><ul>"
                     + "".join(f"<li>{_e(b)}</li>" for b in report.boundaries) + "</ul>")
    if check is not None:
        parts.append(f'<h2>Banner rule check</h2><p class="rule{"" if check.agree else " bad"}">{_e(check.text)}</p>'
                     f'<p class="note">static rule: {_e(check.rule)}</p>')
        if check.disagreements:
            items = "".join(
                f"<li>{_e(', '.join(f'{k}={_show(v)}' for k, v in d.params.items()))}: observed "
                f"{_e(d.observed)}, banner: {_e(d.banner)}{(' — ' + _e(d.reasons[0])) if d.reasons else ''}</li>"
                for d in check.disagreements)
            parts.append(f"<ul>{items}</ul>")
    parts.append("<h2>Phase diagram</h2>" + _legend(report.cells) + _phase_panels(report))
    parts.append("<h2>Cells</h2>" + _table(report))
    axes = "".join(f"<li><code>{_e(a.field)}</code> = {_e(', '.join(_show(v) for v in a.values))}"
                   f"{' (bisected)' if a.bisect else ''}</li>" for a in report.axes)
    left = (f"<p class=note>engines left out of every cell (--engines): {_e(', '.join(report.engines_left_out))}</p>"
            if report.engines_left_out else "")
    parts.append(f"<h2>Sweep</h2><ul>{axes}</ul>{left}<p class=note>{report.repeat} run(s) per cell, {report.jobs} at "
                 f"a time, stall window {report.stall_window_s if report.stall_window_s is not None else '—'} s; "
                 f"intervals: {_e(report.interval_method)}; {report.wall_s:g} s; kvdiag {_e(report.kvdiag_version)}, "
                 f"{_e(report.created_at)}{'; interrupted' if report.interrupted else ''}</p>")
    parts.append("</main></body></html>\n")
    return "".join(parts)


def render_sweep_text(report: SweepReport) -> str:
    """What the terminal shows at the end: the verdict lines (paths are added by the command)."""
    lines = [report.summary]
    if report.rule is not None and report.rule.context:
        lines.append(f"  in every cell: {', '.join(report.rule.context)}")
    if report.rule is not None and not report.rule.fits and report.rule.wrong:
        lines.append(f"  the rule gets {len(report.rule.wrong)} cell(s) wrong: {', '.join(report.rule.wrong[:5])}")
    if report.rule is not None and report.rule.mixed:
        lines.append(f"  hung in some runs only: {', '.join(report.rule.mixed[:5])}")
    lines += [f"  boundary: {b}" for b in report.boundaries]
    if report.banner_check is not None:
        lines.append(f"  banner check: {report.banner_check.text}")
    for c in report.cells:
        if report.repeat > 1 and c.interval is not None and c.runs:
            values = ", ".join(f"{k}={_show(v)}" for k, v in c.params.items())
            lines.append(f"  {values}: {c.hangs}/{len(c.runs)} hung (95 % CI {_pct(c.interval.low)}–"
                         f"{_pct(c.interval.high)}), {', '.join(f'{k}×{n}' for k, n in c.kinds.items())}")
    return "\n".join(lines)
