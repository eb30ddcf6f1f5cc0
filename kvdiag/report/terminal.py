"""The one terminal rendering of a run's report, for every command: verdict first, then evidence, engines
and where the files are.

All data is passed to rich as :class:`~rich.text.Text` (never as markup), so
log text such as ``[bold]`` or ``[link=...]`` prints literally.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvdiag.model.kinds import VerdictKind
from kvdiag.model.report import Report
from kvdiag.model.verdict import Verdict
from kvdiag.report.envtext import gpu_lines, package_summary
from kvdiag.report.view import ReportView, wait_word

KEY_FRAMES = 12   # frames shown per cited thread besides the ones the verdict rests on
_DISPLAY_STYLE = {"ok": "bold green", "warn": "bold yellow", "bad": "bold red", "fail": "bold magenta",
                  "unk": "bold cyan"}
# One definition per kind (KIND_SPECS in kvdiag.model): its display class picks the style.
_KIND_STYLE = {k.value: _DISPLAY_STYLE[k.spec.display] for k in VerdictKind}


def _kind_style(kind: str) -> str:
    return _KIND_STYLE.get(kind, "bold red")


def verdict_head(v: Verdict) -> list[Text]:
    """The verdict's first two lines (kind, confidence, engine; its summary): what ``kvdiag capture`` says
    as soon as the evidence is in, and what the full rendering opens with."""
    head = Text()
    head.append("verdict: ", style="bold")
    head.append(v.kind.value, style=_kind_style(v.kind.value))
    head.append(f"  ({v.confidence.value} confidence)", style="dim")
    if v.engine:
        head.append("  engine ", style="dim")
        head.append(v.engine, style="bold")
    return [head, Text(v.summary)]


def _head(report: Report) -> list[Text]:
    if report.ab is None:
        return verdict_head(report.verdict)
    # An A/B's one outcome is the comparison; the stock side's verdict is its evidence.
    head = Text()
    head.append("outcome: ", style="bold")
    head.append(report.ab.headline(), style="bold green" if report.ab.separated else "bold red")
    head.append(f"  exit {report.exit_code}", style="dim")
    return [head, Text(report.verdict.summary)]


def render_terminal(view: ReportView, console: Console, paths: Mapping[str, Path] | None = None,
                    *, files: bool = True, said: str | None = None) -> None:
    """Print the verdict, cited threads with their key frames, engines, findings and (``files``) where the
    report files are. ``said``: the head already printed (:func:`verdict_head`), not repeated when the same."""
    report = view.report
    v = report.verdict
    kind = v.kind.value
    head = _head(report)
    if said is None or said != "\n".join(t.plain for t in head):
        for line in head:
            console.print(line)
    if report.simulated_engines:
        console.print(Text(f"simulated engines: {', '.join(report.simulated_engines)} (kvdiag's simulated "
                           "vLLM-shaped engine, not a real vLLM)", style="yellow"))
    if report.ab is not None:
        console.print(Text(f"the stock side's verdict: {kind} ({v.confidence.value} confidence)", style="bold"))
    if v.confidence_reasons:
        console.print(Text(f"confidence {v.confidence.value}: " + "; ".join(v.confidence_reasons), style="dim"))
    if v.signature:
        console.print(Text(f"signature: {v.signature}", style="bold"))
    if v.known is not None:
        line = Text(v.known.line(), style="bold cyan")
        if v.known.workaround:
            line.append(f"; workaround: {v.known.workaround}", style="")
        console.print(line)
    if report.interrupted:
        console.print(Text("the run was interrupted: partial report", style="yellow"))
    if report.stall_to_verdict_s is not None:
        console.print(Text(f"stall detected → verdict: {report.stall_to_verdict_s:.1f} s", style="dim"))
    if v.cycle:
        cycle = list(v.cycle)
        if cycle[0] != cycle[-1]:
            cycle.append(cycle[0])
        console.print(Text("wait-for cycle: " + " → ".join(cycle), style="red" if v.kind.is_hang else ""))

    if view.evidence:
        console.print(Text("evidence (→ the frames the verdict rests on):" if view.has_key_frames else "evidence:",
                           style="bold"))
    for ev in view.evidence:
        item = ev.item
        title = Text()
        if item.node:
            title.append(f"node {item.node} ", style="bold")
        title.append(f"pid {item.pid} tid {item.tid}", style="bold")
        if item.engine:
            title.append(f" [{item.engine}]", style="dim")
        title.append("  " + item.role, style="cyan")
        console.print(title)
        # The frames the rule rests on in bold (always shown), the rest of the citation dimmed.
        shown = [(n, text, mark) for n, (text, mark) in enumerate(ev.lines) if n < KEY_FRAMES or mark == "key"]
        for _, text, mark in shown:
            if mark is None:
                console.print(Text("    " + text))
            elif mark == "key":
                console.print(Text("  → " + text, style="bold"))
            else:
                console.print(Text("    " + text, style="dim"))
        if len(ev.lines) > len(shown):
            console.print(Text(f"    … {len(ev.lines) - len(shown)} more frames", style="dim"))

    if report.engines:
        # Identifiers (names, kinds, pids) are never broken across lines, at any width: only the
        # health sentence wraps, at its spaces. No column rules, so seven columns fit in 80.
        table = Table(title="engines", title_justify="left", box=None, pad_edge=False, header_style="bold")
        for col in ("engine", "allocator", "phase", "healthy", "verdict", "EngineCore", "banner"):
            table.add_column(col, no_wrap=col != "healthy", overflow="ellipsis" if col == "healthy" else "crop",
                             min_width=8 if col == "healthy" else None)
        for e in report.engines:
            if e.banner_risk is not None:
                # short words: the table must fit 80 columns (the report's banner section has the long ones)
                risk_text = Text("RISK" if e.banner_risk.risky else "RISK@load" if e.banner_risk.at_risk else "ok",
                                 style="bold red" if e.banner_risk.at_risk else "green")
            else:
                risk_text = Text("none", style="dim")
            verdict = e.verdict.value if e.verdict is not None else None
            table.add_row(
                Text(e.name), Text(e.allocator or "—"), Text(e.phase.value),
                Text(e.health or ("yes" if e.healthy else "no"), style="green" if e.healthy else "red"),
                Text(verdict, style=_kind_style(verdict)) if verdict else Text("—"),
                Text(str(e.pids.engine_core or "—")), risk_text)
        console.print(table)
        for e in report.engines:
            if not e.healthy and e.last_log_line:
                line = Text(f"  {e.name} last log line: ", style="dim")
                line.append(e.last_log_line, style="")
                console.print(line)

    if len(report.verdicts_by_engine) > 1:
        console.print(Text("per engine:", style="bold"))
        for name, ev_ in report.verdicts_by_engine.items():
            line = Text(f"  {name}: ")
            line.append(ev_.kind.value, style=_kind_style(ev_.kind.value))
            line.append(f": {ev_.summary}")
            console.print(line)

    waits = [w for w in report.thread_waits if w.purpose.value != "running"]
    if waits:
        stuck = [w for w in waits if w.stuck]
        console.print(Text(f"waits: {len(stuck)} outcome-wait(s) stuck, "
                           f"{sum(1 for w in waits if w.purpose.value == 'new_work')} waiting for new work, "
                           f"{sum(1 for w in report.thread_waits if w.purpose.value == 'running')} running",
                           style="bold" if stuck else "dim"))
        for w in (stuck or waits)[:8]:
            line = Text(f"  pid {w.pid} tid {w.tid}{f' ({w.name})' if w.name else ''}: ")
            line.append(wait_word(w), style="red" if w.stuck else "dim")
            line.append(f" — {w.what}")
            console.print(line)

    for f in report.findings:
        line = Text("  ")
        line.append(f.kind, style="yellow")
        if f.engine:
            line.append(f" [{f.engine}]", style="dim")
        line.append(": " + f.message)
        console.print(line)

    env = report.environment
    if env is not None:
        console.print(Text(f"  environment: {env.os}, kernel {env.kernel}, Python {env.python}, "
                           f"{package_summary(env)}; {'; '.join(gpu_lines(env))}", style="dim"))
        if env.ptrace.problem:
            console.print(Text(f"  ptrace: {env.ptrace.problem}; fix: {env.ptrace.fix}", style="yellow"))

    if not files:
        return
    if paths:
        for name, path in paths.items():
            console.print(Text(f"  {name}: {path}"))
    elif report.bundle_path:
        console.print(Text(f"  bundle: {report.bundle_path}"))
