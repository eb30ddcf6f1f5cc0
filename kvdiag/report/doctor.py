"""`kvdiag doctor`'s report for the terminal: the headline facts, the environment, each known risk."""

from __future__ import annotations

from rich.console import Console
from rich.padding import Padding
from rich.text import Text

from kvdiag.model.doctor import DoctorReport, RiskStatus
from kvdiag.model.environment import EnvironmentRecord
from kvdiag.report.envtext import environment_lines

_STATUS_STYLE = {RiskStatus.RISK: "bold red", RiskStatus.WARN: "yellow", RiskStatus.OK: "green",
                 RiskStatus.UNKNOWN: "yellow", RiskStatus.NOT_APPLICABLE: "dim"}


def headline(env: EnvironmentRecord) -> list[str]:
    """The two facts a reader looks for first: GPUs and kvcached."""
    if env.gpus:
        gpu = f"GPUs: {len(env.gpus)} ({', '.join(sorted({g.name for g in env.gpus}))}), CUDA driver " \
              f"{env.cuda_driver or '?'}"
    else:
        gpu = f"GPU: none ({(env.gpu_note or 'no GPU').removeprefix('no GPU: ')})"
    lines = [gpu]
    for ip in env.engine_packages:
        k = ip.kvcached
        if k is not None:
            lines.append(f"kvcached of {ip.who} ({ip.python}): "
                         + (f"{k.version or '?'} at {k.location}: {k.summary}" if k.installed else "not installed"))
    k = env.kvcached
    mine = " (kvdiag's Python)" if env.engine_packages else ""
    if k.installed:
        lines.append(f"kvcached{mine}: {k.version or '?'} at {k.location}: {k.summary}")
    else:
        lines.append(f"kvcached{mine}: not installed here, so there is no kvcached build or live state to check")
    return lines


def render_doctor(report: DoctorReport, console: Console) -> None:
    """The doctor report on ``console``."""
    console.rule(Text("kvdiag doctor", style="bold"))
    for line in headline(report.environment):
        console.print(Text(line, style="bold"))
    if report.scenario:
        console.print(Text(f"scenario: {report.scenario}"))
    if report.logs:
        console.print(Text(f"log{'s' if len(report.logs) > 1 else ''}: {', '.join(report.logs)}"))
    if not report.scenario and not report.logs:
        console.print(Text("no scenario given: pass --scenario FILE (or --log LOG) to check a planned setup",
                           style="dim"))
    console.print(Text("environment", style="bold"))
    for line in environment_lines(report.environment):
        console.print(Text("  " + line))
    # One block per row, not a five-column table: at 80 columns a table breaks identifiers and the
    # environment assignments a reader copies (KVCACHED_PAGE_PREALLOC_ENABLED=false); here text wraps
    # only at spaces, under a hanging indent.
    console.print(Text("known risks", style="bold"))
    width = max(len(s.value) for s in RiskStatus) + 2
    for c in report.checks:
        head = Text()
        head.append(f"{c.status.value:<{width}}", style=_STATUS_STYLE[c.status])
        head.append(c.check, style="bold")
        head.append(f"  {c.subject}")
        console.print(head)
        console.print(Padding(Text(c.detail + (f" [{c.upstream}]" if c.upstream else "")), (0, 0, 0, width)))
        if c.fix:
            console.print(Padding(Text(f"change: {c.fix}"), (0, 0, 0, width)))
    for c in report.checks:
        if c.status is RiskStatus.WARN:
            console.print(Text(f"warning: {c.check}: {c.detail}" + (f"; fix: {c.fix}" if c.fix else ""),
                               style="yellow"))
    risks = [c for c in report.checks if c.status is RiskStatus.RISK]
    if risks:
        # One count per check, with how many subjects it applies to: the count matches the names listed.
        kinds = sorted({c.check for c in risks})
        each = [f"{k} ×{n}" if (n := sum(1 for c in risks if c.check == k)) > 1 else k for k in kinds]
        console.print(Text(f"{len(kinds)} known risk(s) apply: {', '.join(each)} (exit {report.exit_code})",
                           style="bold red"))
    else:
        console.print(Text(f"no known risk applies (exit {report.exit_code})", style="bold green"))
