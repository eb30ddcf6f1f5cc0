"""Render a sweep's report from its view (:class:`~kvdiag.report.sweepview.SweepView`), each renderer
``(view) -> str``: report.json, one self-contained HTML page (table and phase diagram, no network, every text
escaped) and the terminal summary. Renders only what the report holds."""

from __future__ import annotations

import html
from collections.abc import Callable

from kvdiag.report.sweepview import SweepView, pct, show

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


def _phase_panels(view: SweepView) -> str:
    """One CSS grid per setting of the axes beyond the first two: x = the last axis, y = the one before."""
    if not view.panels:
        return "<p>no cells</p>"
    out: list[str] = []
    for panel in view.panels:
        rows: list[str] = []
        for y, cells in panel.rows:
            rows.append(f'<div class="ax">{_e(y)}</div>')
            for cell in cells:
                if cell is None:
                    rows.append('<div class="c" style="background:#f5f5f5"></div>')
                    continue
                off = " off" if cell.disagrees else ""
                tag = "a" if cell.link else "div"
                href = f' href="{_e(cell.link)}"' if cell.link else ""
                mark = "!" if off else ""
                rows.append(f'<{tag} class="c{off}"{href} style="background:{cell.colour}" '
                            f'title="{_e(cell.title)}">{_e(cell.label)}{mark}</{tag}>')
        rows.append('<div class="ax"></div>' + "".join(f'<div class="ax">{_e(v)}</div>' for v in panel.xs))
        grid = (f'<div class="grid" style="grid-template-columns:auto repeat({len(panel.xs)},minmax(4.5em,auto))">'
                + "".join(rows) + "</div>")
        # A one-axis grid has no rows to name, and a single panel no title ("all cells", "rows ↑" read as noise).
        head = (f'<div class="note">{_e(panel.title)}</div>' if panel.title else "") + (
            f'<div class="note">rows ↑ {_e(panel.y_label)}</div>' if panel.y_label else "")
        out.append(f'<div class="panel">{head}{grid}'
                   f'<div class="note">columns → {_e(panel.x_label)}</div></div>')
    return "".join(out)


def _legend(view: SweepView) -> str:
    spans = "".join(f'<span style="background:{col}">{_e(word)}</span>' for word, col in view.legend)
    return (f'<p class="legend">{spans} <span style="background:#fff;color:#222;outline:3px solid #ffb300">'
            f'! rule or banner disagrees</span></p>')


def _table(view: SweepView) -> str:
    labels = [a.label for a in view.report.axes]
    head = "".join(f"<th>{_e(lbl)}</th>" for lbl in labels)
    head += ("<th>outcome</th><th>hung</th><th>95 % CI</th><th>verdicts</th><th>signature</th>"
             "<th>time to hang (median, max)</th><th>time to healthy (median, max)</th><th>banner</th>"
             "<th>rule</th><th>runs</th>")
    rows: list[str] = []
    for c in (cv.cell for cv in view.cells):
        iv = f"{pct(c.interval.low)}–{pct(c.interval.high)}" if c.interval else "—"
        tth = f"{c.time_to_hang.median:.2f}s, {c.time_to_hang.max:.2f}s" if c.time_to_hang else "—"
        tok = f"{c.time_to_healthy.median:.2f}s, {c.time_to_healthy.max:.2f}s" if c.time_to_healthy else "—"
        banner = {True: "risk", False: "no risk", None: "—"}[c.banner_predicts_hang]
        rule = {True: "hang", False: "no hang", None: "—"}[c.rule_predicts_hang]
        links = " ".join(f'<a href="{_e(r.path)}/report.html">{r.index + 1}</a>' for r in c.runs if r.path)
        notes = f'<div class="note">{_e("; ".join(c.notes))}</div>' if c.notes else ""
        rows.append(
            f'<tr class="{_e(c.outcome)}">' + "".join(f"<td>{_e(show(c.params.get(lbl)))}</td>" for lbl in labels)
            + f'<td class="o">{_e(c.outcome)}{notes}</td><td>{c.hangs}/{len(c.runs)}</td><td>{_e(iv)}</td>'
            f'<td>{_e(", ".join(f"{k}×{n}" for k, n in c.kinds.items()))}</td>'
            f'<td>{_e(", ".join(c.signatures) or "—")}</td><td>{_e(tth)}</td><td>{_e(tok)}</td>'
            f'<td>{_e(banner)}</td><td>{_e(rule)}</td><td>{links}</td></tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def render_sweep_html(view: SweepView) -> str:
    report = view.report
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
                f"<li>{_e(', '.join(f'{k}={show(v)}' for k, v in d.params.items()))}: observed "
                f"{_e(d.observed)}, banner: {_e(d.banner)}{(' — ' + _e(d.reasons[0])) if d.reasons else ''}</li>"
                for d in check.disagreements)
            parts.append(f"<ul>{items}</ul>")
    parts.append("<h2>Phase diagram</h2>" + _legend(view) + _phase_panels(view))
    parts.append("<h2>Cells</h2>" + _table(view))
    axes = "".join(f"<li><code>{_e(a.field)}</code> = {_e(', '.join(show(v) for v in a.values))}"
                   f"{' (bisected)' if a.bisect else ''}</li>" for a in report.axes)
    left = (f"<p class=note>engines left out of every cell (--engines): {_e(', '.join(report.engines_left_out))}</p>"
            if report.engines_left_out else "")
    parts.append(f"<h2>Sweep</h2><ul>{axes}</ul>{left}<p class=note>{report.repeat} run(s) per cell, {report.jobs} at "
                 f"a time, stall window {report.stall_window_s if report.stall_window_s is not None else '—'} s; "
                 f"intervals: {_e(report.interval_method)}; {report.wall_s:g} s; kvdiag {_e(report.kvdiag_version)}, "
                 f"{_e(report.created_at)}{'; interrupted' if report.interrupted else ''}</p>")
    parts.append("</main></body></html>\n")
    return "".join(parts)


def render_sweep_text(view: SweepView) -> str:
    """What the terminal shows at the end: the verdict lines (paths are added by the command)."""
    report = view.report
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
            values = ", ".join(f"{k}={show(v)}" for k, v in c.params.items())
            lines.append(f"  {values}: {c.hangs}/{len(c.runs)} hung (95 % CI {pct(c.interval.low)}–"
                         f"{pct(c.interval.high)}), {', '.join(f'{k}×{n}' for k, n in c.kinds.items())}")
    return "\n".join(lines)


def render_sweep_json(view: SweepView) -> str:
    """report.json: the stored report itself (what ``kvdiag report`` re-renders the page from)."""
    return view.report.model_dump_json(indent=1) + "\n"


# A sweep's report files and their renderers, each ``(view) -> str``.
SWEEP_RENDERERS: dict[str, Callable[[SweepView], str]] = {"report.json": render_sweep_json,
                                                          "report.html": render_sweep_html}
