"""report.html: one self-contained page (no network) rendered with jinja2.

Everything shown comes from the report and the bundle (redacted: :mod:`kvdiag.redact`) and
raw files inside the bundle folder. All text goes through jinja2's
autoescape; the only unescaped insertions are this package's own CSS/JS and
the report as JSON, escaped for a ``<script type="application/json">`` block.
A Content-Security-Policy admits only the page's own script (by hash), so a
bug in escaping still could not run injected code.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

import jinja2
from markupsafe import Markup

from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import VerdictKind
from kvdiag.model.report import Report
from kvdiag.redact.rules import redact_text
from kvdiag.report.json import report_dict
from kvdiag.report.view import ReportView, clean_text, page_href

__all__ = ["compile_templates", "cycle_diagram", "render_html", "script_json"]

TEMPLATES = Path(__file__).parent / "templates"
RAW_FILE_CAP = 256 * 1024        # characters kept per raw file (head and tail)
RAW_TOTAL_CAP = 4 * 1024 * 1024  # characters of raw text embedded in one page
MAX_CYCLE_NODES = 10

KIND_CLASS = {k.value: k.spec.display for k in VerdictKind}   # one definition per kind (kvdiag.model)


# ---------------------------------------------------------------- escaping helpers

def script_json(data: object) -> Markup:
    """JSON safe inside ``<script type="application/json">``: no ``</script>``, no HTML comments.

    ``<``, ``>`` and ``&`` become ``\\u003c`` etc. (still valid JSON, parsed back
    unchanged); U+2028/2029 are escaped because older JS parsers treat them as
    line breaks.
    """
    text = json.dumps(data, ensure_ascii=False, sort_keys=True)
    text = (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))
    return Markup(text)


# ---------------------------------------------------------------- the wait-for cycle diagram

@dataclass
class DiagramNode:
    x: float
    y: float
    w: float
    h: float
    lines: list[str]
    title: str
    kind: str                         # "gil" or "thread"


@dataclass
class DiagramEdge:
    d: str
    label: str
    lx: float
    ly: float


@dataclass
class Diagram:
    width: int
    height: int
    nodes: list[DiagramNode] = field(default_factory=list)
    edges: list[DiagramEdge] = field(default_factory=list)


_NODE_LINES = 7   # a box of the cycle diagram holds this many lines of 30 characters


def _wrap(label: str, width: int = 30, max_lines: int = 3) -> list[str]:
    words = label.split()
    lines: list[str] = []
    cur = ""
    for word in words:
        while len(word) > width:  # very long identifiers are split hard
            if cur:
                lines.append(cur)
                cur = ""
            lines.append(word[:width])
            word = word[width:]
        if not cur:
            cur = word
        elif len(cur) + 1 + len(word) <= width:
            cur += " " + word
        else:
            lines.append(cur)
            cur = word
    if cur:
        lines.append(cur)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: width - 1] + "…"
    return lines or [""]


def _is_gil(label: str) -> bool:
    return bool(re.search(r"\bGIL\b", label)) and len(label) <= 24


def _boundary(cx: float, cy: float, hw: float, hh: float, dx: float, dy: float) -> tuple[float, float]:
    """Where a ray from the centre of a box in direction (dx, dy) leaves the box."""
    ts = []
    if abs(dx) > 1e-9:
        ts.append(hw / abs(dx))
    if abs(dy) > 1e-9:
        ts.append(hh / abs(dy))
    t = min(ts) if ts else 0.0
    return cx + dx * t, cy + dy * t


def cycle_diagram(labels: list[str]) -> Diagram | None:
    """Lay out the wait-for cycle: nodes on a circle, edge A→B meaning "A waits for B".

    An edge leaving a GIL node reads "held by" (whoever wants the GIL waits for its holder); the
    page's legend says both. Returns None when there is nothing (or too much) to draw.
    """
    nodes_labels = [lab for lab in labels if lab]
    if len(nodes_labels) > 1 and nodes_labels[0] == nodes_labels[-1]:
        nodes_labels = nodes_labels[:-1]  # a closed cycle lists its first node again
    n = len(nodes_labels)
    if n == 0 or n > MAX_CYCLE_NODES:
        return None
    nw = 230.0
    # Every word of a label stays in its box (the function a thread waits in is its last words): the
    # box grows a line at a time instead of cutting the label.
    wrapped = [_wrap(label, max_lines=_NODE_LINES) for label in nodes_labels]
    nh = max(58.0, 18.0 + 14.0 * max(len(lines) for lines in wrapped))
    if n <= 2:
        width, height = 760, int(192 + nh)
        centers = [(150.0, height / 2), (610.0, height / 2)][:n]
    else:
        radius = 95.0 + 16.0 * n + (nh - 58.0) / 2
        ring = [(radius * math.sin(2 * math.pi * i / n), -radius * math.cos(2 * math.pi * i / n))
                for i in range(n)]
        # Crop to the nodes (plus room for bent edges): a triangle leaves the bottom of its circle empty.
        pad = 50.0
        min_x = min(x for x, _ in ring) - nw / 2 - pad
        min_y = min(y for _, y in ring) - nh / 2 - pad
        width = int(max(x for x, _ in ring) + nw / 2 + pad - min_x)
        height = int(max(y for _, y in ring) + nh / 2 + pad - min_y)
        centers = [(x - min_x, y - min_y) for x, y in ring]
    diagram = Diagram(width=width, height=height)
    for (x, y), label, lines in zip(centers, nodes_labels, wrapped, strict=True):
        gil = _is_gil(label)
        w = 120.0 if gil else nw
        diagram.nodes.append(DiagramNode(x=x - w / 2, y=y - nh / 2, w=w, h=nh, lines=lines,
                                         title=label, kind="gil" if gil else "thread"))
    if n == 1:
        x, y = centers[0]
        top = y - nh / 2
        d = f"M {x - 30:.1f} {top:.1f} C {x - 60:.1f} {top - 70:.1f} {x + 60:.1f} {top - 70:.1f} {x + 30:.1f} {top:.1f}"
        diagram.edges.append(DiagramEdge(d=d, label="waits for itself", lx=x, ly=top - 58))
        return diagram
    bend = 55.0 if n == 2 else 35.0
    for i in range(n):
        (ax, ay), (bx, by) = centers[i], centers[(i + 1) % n]
        a_node, b_node = diagram.nodes[i], diagram.nodes[(i + 1) % n]
        dx, dy = bx - ax, by - ay
        length = math.hypot(dx, dy) or 1.0
        # Bend every edge to its left, so A→B and B→A (two nodes) do not overlap.
        px, py = -dy / length, dx / length
        mx, my = (ax + bx) / 2 + px * bend, (ay + by) / 2 + py * bend
        sx, sy = _boundary(ax, ay, a_node.w / 2 + 4, nh / 2 + 4, mx - ax, my - ay)
        ex, ey = _boundary(bx, by, b_node.w / 2 + 8, nh / 2 + 8, mx - bx, my - by)
        lx, ly = 0.25 * sx + 0.5 * mx + 0.25 * ex, 0.25 * sy + 0.5 * my + 0.25 * ey
        label = "held by" if a_node.kind == "gil" else "waits for"
        diagram.edges.append(DiagramEdge(d=f"M {sx:.1f} {sy:.1f} Q {mx:.1f} {my:.1f} {ex:.1f} {ey:.1f}",
                                         label=label, lx=lx, ly=ly))
    return diagram


# ---------------------------------------------------------------- timeline diagram

@dataclass
class TimelineMark:
    x: float
    y: float
    cls: str
    title: str


@dataclass
class TimelineDiagram:
    width: int
    height: int
    lanes: list[tuple[str, float]]
    marks: list[TimelineMark]
    ticks: list[tuple[float, str]]
    left: float
    right: float


def _event_class(event: str) -> str:
    e = event.lower()
    if "stall" in e or "hang" in e or "timeout" in e or "timed out" in e:
        return "bad"
    if "exit" in e or "crash" in e or "oom" in e or "fail" in e or "error" in e:
        return "fail"
    if "banner" in e:
        return "warn"
    if "capture" in e:
        return "info"
    if "ready" in e or "healthy" in e or "serving" in e or "startup complete" in e:
        return "ok"
    return "plain"


def timeline_diagram(report: Report) -> TimelineDiagram | None:
    events = report.timeline
    if not events:
        return None
    lane_names: list[str] = []
    for ev in events:
        name = ev.engine or "run"
        if name not in lane_names:
            lane_names.append(name)
    left, right, top, lane_h = 170.0, 880.0, 30.0, 30.0
    width = 900
    height = int(top + lane_h * len(lane_names) + 20)
    t0 = min(ev.t for ev in events)
    t1 = max(ev.t for ev in events)
    span = (t1 - t0) or 1.0

    def xpos(t: float) -> float:
        return left + (right - left) * (t - t0) / span

    lanes = [(name, top + lane_h * i + lane_h / 2) for i, name in enumerate(lane_names)]
    lane_y = dict(lanes)
    marks: list[TimelineMark] = []
    for ev in events:
        title = f"t={ev.t:.2f}s {ev.engine + ': ' if ev.engine else ''}{ev.event}"
        if ev.detail:
            title += f" — {ev.detail}"
        marks.append(TimelineMark(x=xpos(ev.t), y=lane_y[ev.engine or "run"], cls=_event_class(ev.event),
                                  title=title))
    step = _nice_step(span / 6)
    ticks: list[tuple[float, str]] = []
    k = math.ceil(t0 / step)
    while k * step <= t1 + 1e-9 and len(ticks) < 20:
        ticks.append((xpos(k * step), f"{k * step:g}s"))
        k += 1
    return TimelineDiagram(width=width, height=height, lanes=lanes, marks=marks, ticks=ticks,
                           left=left, right=right)


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return float(m * mag)
    return float(10 * mag)


# ---------------------------------------------------------------- processes, threads, raw files

def _read_capped(path: Path, cap: int) -> tuple[str, int, bool]:
    """Text of ``path`` (head and tail when larger than ``cap``), its size, and whether it was cut."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        if size <= cap:
            data = fh.read(cap + 1)
            return data.decode("utf-8", errors="replace"), size, False
        head = fh.read(cap // 2)
        fh.seek(max(size - cap // 2, 0))
        tail = fh.read(cap // 2)
    omitted = size - len(head) - len(tail)
    text = (head.decode("utf-8", errors="replace") + f"\n\n… {omitted} bytes omitted …\n\n"
            + tail.decode("utf-8", errors="replace"))
    return text, size, True


def _inside(base: Path, rel: str) -> Path | None:
    """``base/rel`` if it stays inside ``base`` (a foreign bundle may name ../../etc/...)."""
    try:
        root = base.resolve()
        target = (base / rel).resolve()
    except (OSError, RuntimeError):
        return None
    if target == root or root not in target.parents:
        return None
    return target


def raw_outputs(bundle: Bundle | None, bundle_dir: Path | None) -> list[dict[str, Any]]:
    """Raw tool outputs and engine logs from the bundle folder, redacted and size-capped."""
    if bundle is None or bundle_dir is None or not bundle_dir.is_dir():
        return []
    wanted: list[tuple[str, str]] = []
    for eng in bundle.engines:
        if eng.log_path:
            wanted.append((f"log of {eng.name}", eng.log_path))
    for proc in bundle.processes:
        for tool in proc.tools:
            if tool.raw_path:
                wanted.append((f"{tool.tool} — pid {proc.pid} ({proc.role.value})", tool.raw_path))
    if (bundle_dir / "scenario.yaml").is_file():
        wanted.append(("scenario", "scenario.yaml"))
    out: list[dict[str, Any]] = []
    budget = RAW_TOTAL_CAP
    seen: set[str] = set()
    for title, rel in wanted:
        if rel in seen:
            continue
        seen.add(rel)
        entry: dict[str, Any] = {"title": title, "path": rel, "text": None,
                                 "size": None, "truncated": False, "note": None}
        path = _inside(bundle_dir, rel)
        if path is None:
            entry["note"] = "path is outside the bundle folder; not embedded"
        elif not path.is_file():
            entry["note"] = "file not in the bundle"
        elif budget <= 0:
            entry["note"] = "not embedded: the page's size limit is reached (see the bundle folder)"
        else:
            try:
                text, size, cut = _read_capped(path, min(RAW_FILE_CAP, budget))
            except OSError as exc:
                entry["note"] = f"cannot read: {exc.strerror or exc}"
            else:
                budget -= len(text)
                entry.update(text=clean_text(redact_text(text)), size=size, truncated=cut)
        out.append(entry)
    return out


def bundle_href(rel: str | None, bundle_path: str | None) -> str | None:
    """A link from the report page to ``rel`` (a path inside the bundle folder), or None.

    ``bundle_path`` is where the bundle folder is as seen from the page (report.bundle_path: "bundle"
    beside report.html). Absolute paths and paths leaving the bundle (a foreign bundle may name
    ../../etc/...) get no link.
    """
    if not rel or bundle_path is None:
        return None
    parts = PurePosixPath(rel.replace("\\", "/")).parts
    if not parts or rel.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
        return None
    base = bundle_path.replace("\\", "/").rstrip("/")
    return quote(f"{base}/{'/'.join(parts)}" if base else "/".join(parts), safe="/")


# ---------------------------------------------------------------- page

@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    """One environment per process: it keeps the compiled template (compiling it costs a quarter second)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["kindclass"] = lambda kind: KIND_CLASS.get(str(kind), "unk")
    env.filters["num"] = _fmt_num
    env.filters["clean"] = lambda s: clean_text(str(s)) if s is not None else ""
    # Plain text (autoescaped by the template), unlike jinja's tojson which returns markup.
    env.filters["jsontext"] = lambda v: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return env


def compile_templates() -> None:
    """Compile the report's template now (a command that renders later calls this while it waits on
    something else: the capture tools)."""
    _env().get_template("report.html.j2")


def _fmt_num(value: object, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render_html(view: ReportView) -> str:
    """Render the self-contained HTML page of a view.

    The view's stacks carry the evidence's key frames highlighted; its ``bundle_dir`` adds the raw tool
    outputs and logs found in it.
    """
    report, safe_bundle, ab, bundle_dir = view.report, view.bundle, view.ab, view.bundle_dir   # redacted
    data = report_dict(report)

    def link(rel: str | None) -> str | None:
        """A link into the bundle folder; none to a file the folder does not hold."""
        href = bundle_href(rel, report.bundle_path)
        if href is None or (bundle_dir is not None and rel and _inside(bundle_dir, rel) is None):
            return None
        if bundle_dir is not None and rel and not (bundle_dir / rel).is_file():
            return None
        return href

    def engine_log(name: str, rel: str | None) -> str | None:
        """An engine's log; an A/B engine ("stock/coder") keeps it in its own run's bundle."""
        if ab is None:
            return link(rel)
        side = next((x for x in ab["sides"] if name.startswith(f"{x['label']}/")), None)
        if side is None or not rel:
            return None
        return page_href(f"{side['bundle']}/{rel}", str(ab["base"]))

    script = (TEMPLATES / "report.js").read_text(encoding="utf-8")
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    csp = (f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{digest}'; "
           "base-uri 'none'; form-action 'none'")
    page = _env().get_template("report.html.j2").render(
        r=report,
        data=data,
        kind=report.verdict.kind.value,
        hang=report.verdict.kind.is_hang,
        diagram=cycle_diagram(report.verdict.cycle),
        chain=view.chain,
        timeline=timeline_diagram(report),
        soak=view.soak,
        processes=view.processes,
        evidence=view.evidence,
        has_key_frames=view.has_key_frames,
        engine_run=view.engine_run,
        # An A/B bundle holds no raw files of its own (each run's bundle does): list only what is here.
        raw=[item for item in raw_outputs(safe_bundle, bundle_dir) if ab is None or item["text"] is not None],
        have_bundle=safe_bundle is not None,
        link=link,
        engine_log=engine_log,
        ab=ab,
        report_json=script_json(data),
        page_js=Markup(script),
        csp=csp,
    )
    return page
