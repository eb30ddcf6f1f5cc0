"""report.md: a summary to paste into a GitHub issue (verdict, frames, banners, engines, environment)."""

from __future__ import annotations

import re

from kvdiag.logs.lines import MAX_LINE
from kvdiag.model.report import ReportEngine
from kvdiag.report.envtext import environment_lines
from kvdiag.report.view import MAX_WAIT_ROWS, EvidenceLines, ReportView, clean_text, wait_word

MAX_TIMELINE = 40
MAX_THREAD_FRAMES = 30
KEY_MARK = "→ "       # in front of a frame the verdict rests on (code blocks cannot be bolded)


def _cell(value: object) -> str:
    """A table cell: one line, pipes escaped, HTML neutralised (GitHub renders inline HTML)."""
    if value is None:
        return "—"
    text = clean_text(str(value)).replace("\r", " ").replace("\n", " ")
    return _inline(text).replace("|", "\\|")


def _inline(text: str) -> str:
    # GitHub strips unknown tags; escape so log text like "<pad>" stays visible and inert.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _fence(lines: list[str], lang: str = "text") -> str:
    """A code block whose fence is longer than any backtick run inside it."""
    body = "\n".join(clean_text(line) for line in lines)
    longest = max((len(m) for m in re.findall(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{body}\n{fence}"


def _code(text: str) -> str:
    text = clean_text(text).replace("\n", " ")
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    ticks = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def render_markdown(view: ReportView) -> str:
    """Render the Markdown summary of a view (with the stacks of the cited threads when it has a bundle)."""
    report = view.report
    v = report.verdict
    out: list[str] = []
    ab = view.ab
    if ab is not None:  # the A/B outcome, not the stock side's hang, heads an A/B report
        out.append(f"### kvdiag: {ab['title']} (" + ", ".join(f"{side['label']}: `{side['verdict']}`"
                                                          for side in ab["sides"]) + ")")
    else:
        out.append(f"### kvdiag: `{v.kind.value}` ({v.confidence.value} confidence)")
    out.append("")
    if report.simulated_engines:
        out += [f"> **Simulated engines:** {', '.join(_code(n) for n in report.simulated_engines)} ran kvdiag's "
                "simulated vLLM-shaped engine, not a real vLLM (model names are labels).", ""]
    out.append(f"**{_inline(clean_text(v.summary))}**")
    out.append("")
    facts = [f"command: {_code(report.command)}", f"exit code: {report.exit_code}"]
    if v.engine:
        facts.append(f"engine: {_code(v.engine)}")
    if report.scenario:
        facts.append(f"scenario: {_code(report.scenario)}")
    out.append(" · ".join(facts))
    if v.signature:
        out += ["", f"signature: {_code(v.signature)}"]
    if v.known is not None:
        known = _inline(clean_text(v.known.line()))
        if v.known.workaround:
            known += f"; workaround: {_code(v.known.workaround)}"
        out += ["", f"> **{known}**"]
    if report.interrupted:
        out += ["", "> [!WARNING]", "> The run was interrupted; this report holds what was captured until then."]
    if view.soak is not None:
        # A soak's figures come first, with their units (the plots are in report.html).
        out += ["", f"#### {view.soak.title}", "", "| | |", "|---|---|"]
        out += [f"| {f.label} | {_cell(f.value)}{' (' + _cell(f.note) + ')' if f.note else ''} |"
                for f in view.soak.figures]
    if ab is not None:
        out += ["", "| allocator | verdict | exit code | engines | report |",
                "|---|---|---|---|---|"]
        for side in ab["sides"]:
            engines = ", ".join(f"{e['name']}: {e['verdict'] or e['phase']}" for e in side["engines"])
            out.append("| " + " | ".join(_cell(x) for x in (
                side["label"], side["verdict"], side["exit_code"], engines, side["report"])) + " |")
    if v.cycle:
        out += ["", "**Wait-for cycle** (A → B: A waits for B)", "",
                _fence([" → ".join(v.cycle + [v.cycle[0]] if v.cycle[0] != v.cycle[-1] else v.cycle)])]

    if view.evidence:
        out += ["", "#### Evidence"]
        if view.has_key_frames:
            out += ["", f"`{KEY_MARK.strip()}` marks the frames the verdict rests on."]
        for ev in view.evidence:
            item = ev.item
            where = (f"node {_code(item.node)}, " if item.node else "") + f"pid {item.pid}, tid {item.tid}" + (
                f", engine {_code(item.engine)}" if item.engine else "")
            out += ["", f"**{_inline(clean_text(item.role))}** ({where})"]
            if item.frames:
                out += ["", _fence(marked_lines(ev))]

    if report.thread_waits:
        out += ["", "#### What each thread waits for", "",
                "| pid | tid | thread | waits for | in | advanced |", "|---|---|---|---|---|---|"]
        for w in report.thread_waits[:MAX_WAIT_ROWS]:
            out.append("| " + " | ".join(_cell(x) for x in (
                w.pid, w.tid, w.name, wait_word(w), _short(w.what, 100),
                "not observed" if w.advanced is None else "yes" if w.advanced else "no")) + " |")
        if len(report.thread_waits) > MAX_WAIT_ROWS:
            out.append(f"- … {len(report.thread_waits) - MAX_WAIT_ROWS} more threads in report.json")

    findings = report.findings
    if findings:
        out += ["", "#### Findings", ""]
        for f in findings:
            who = f" ({_code(f.engine)})" if f.engine else ""
            out.append(f"- **{_inline(f.kind)}**{who}: {_inline(clean_text(f.message))}")

    banners = [(e, b) for e in report.engines for b in e.banners]
    if banners:
        out += ["", "#### PageAllocator banners", "",
                "| engine | group | layers | mem/layer | page | pages/layer | prealloc | min/max reserved | risk |",
                "|---|---|---|---|---|---|---|---|---|"]
        for e, b in banners:
            out.append("| " + " | ".join(_cell(x) for x in (
                e.name, b.group_id, b.num_layers, f"{b.mem_size_per_layer_mb} MB",
                f"{b.page_size_mb} MB", b.risk.pages_per_layer,
                "on" if b.enable_prealloc else "off",
                f"{b.min_reserved_pages}/{b.max_reserved_pages}",
                f"**{b.risk.label}**" if b.risk.at_risk else "ok")) + " |")
        for e, b in banners:
            for reason in [*b.risk.reasons, *([b.risk.load_risk] if b.risk.load_risk else [])]:
                out.append(f"- {_cell(e.name)}: {_inline(clean_text(reason))}")

    if report.engines and not view.engine_run:    # a plain process: no allocator, phase or banner
        out += ["", "#### Processes", "", "| process | healthy | verdict | last log line |", "|---|---|---|---|"]
        out += ["| " + " | ".join(_cell(x) for x in (
            e.name, _healthy(e), e.verdict.value if e.verdict is not None else None,
            _short(e.last_log_line, MAX_LINE))) + " |" for e in report.engines]
    elif report.engines:
        out += ["", "#### Engines", "",
                "| engine | allocator | phase | healthy | verdict | api_server | engine_core | startup "
                "| last log line |",
                "|---|---|---|---|---|---|---|---|---|"]
        for e in report.engines:
            out.append("| " + " | ".join(_cell(x) for x in (
                e.name, e.allocator, e.phase.value, _healthy(e),
                e.verdict.value if e.verdict is not None else None, e.pids.api_server, e.pids.engine_core,
                f"{e.startup_s:.1f} s" if e.startup_s is not None else None,
                _short(e.last_log_line, MAX_LINE))) + " |")
        for e in report.engines:
            if e.error:
                out.append(f"- {_cell(e.name)} error: {_code(e.error)}")

    cited = _cited_stacks(view)
    if cited:
        out += ["", "<details><summary>Stacks of the cited threads</summary>", ""]
        for title, lines in cited:
            out += [f"**{_inline(title)}**", "", _fence(lines), ""]
        out.append("</details>")

    if report.timeline:
        out += ["", "<details><summary>Timeline</summary>", ""]
        lines = [f"{ev.t:8.2f}s  {ev.engine or '-':<12} {ev.event}" + (f" — {ev.detail}" if ev.detail else "")
                 for ev in report.timeline[:MAX_TIMELINE]]
        if len(report.timeline) > MAX_TIMELINE:
            lines.append(f"… {len(report.timeline) - MAX_TIMELINE} more events in report.json")
        out += [_fence(lines), "", "</details>"]

    out += ["", "#### Environment", ""]
    env_lines = [f"kvdiag {report.kvdiag_version}"]
    env_lines += [f"{k}: {val}" for k, val in report.host.model_dump(exclude_defaults=True).items()]
    if report.stall_window_s is not None:
        env_lines.append(f"stall window: {report.stall_window_s:g} s")
    if report.stall_to_verdict_s is not None:
        env_lines.append(f"stall detected → verdict: {report.stall_to_verdict_s:.1f} s")
    if report.created_at:
        env_lines.append(f"created: {report.created_at}")
    if report.environment is not None:
        env_lines += environment_lines(report.environment)
    red = report.redaction
    env_lines.append(f"redacted: {red.total} value(s)" + (
        f" ({', '.join(f'{k} {n}' for k, n in red.by_kind.items())})" if red.total else ""))
    out.append(_fence(env_lines))
    out.append("")
    return "\n".join(out)


def marked_lines(ev: EvidenceLines) -> list[str]:
    """The cited frames, the key ones marked; a report without key frames lists them unmarked."""
    if ev.item.key_frames is None:
        return [text for text, _ in ev.lines]
    pad = " " * len(KEY_MARK)
    return [(KEY_MARK if mark == "key" else pad) + text for text, mark in ev.lines]


def _healthy(e: ReportEngine) -> str:
    """The engine's health line (derived from its verdict and probes by kvdiag.model.health)."""
    return e.health or ("yes" if e.healthy else "no")


def _short(value: object, width: int = 120) -> str | None:
    if value is None:
        return None
    text = str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _cited_stacks(view: ReportView) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for proc, th in view.cited:
        if not th.frames:
            continue
        pad = " " * len(KEY_MARK) if th.has_key_frames else ""
        lines = [(KEY_MARK if f.key else pad) + f.text for f in th.frames[:MAX_THREAD_FRAMES]]
        if len(th.frames) > MAX_THREAD_FRAMES:
            lines.append(f"… {len(th.frames) - MAX_THREAD_FRAMES} outer frames")
        name = f' "{th.name}"' if th.name else ""
        out.append((f"pid {proc.pid} tid {th.tid}{name} — {th.roles[-1]}", lines))
    return out
