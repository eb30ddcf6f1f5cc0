"""The soak report's plots say what they show: tokens per second, KV cache usage and requests running and
waiting over the load's seconds, each with its unit, the stall marked where it was detected, and no label
drawn over another (checked in the rendered page, then measured in headless Chromium)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cdp import chromium, evaluate

from kvdiag.analyze.diagnosis import diagnose
from kvdiag.model.bundle import Bundle
from kvdiag.model.run import TimelineEvent
from kvdiag.model.soakseries import SoakSample
from kvdiag.report import run_view, write_view

BUNDLE = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "soak_gil_cycle" / "bundle.json"
SVG = "{http://www.w3.org/2000/svg}"
PLOT_LEFT, PLOT_RIGHT, PLOT_TOP, PLOT_BOTTOM = 52.0, 358.0, 12.0, 116.0   # the plot area inside the 370 x 140 svg

# The soak's marks (run-clock seconds); the recorded run's /metrics run to 9.058 s, the plots' right edge.
_SOAK_EVENTS = ("soak load started", "stall onset (last progress)", "stall detected", "soak duration reached")
LAYOUTS = {
    "recorded": {"soak load started": 1.784, "stall onset (last progress)": 3.021, "stall detected": 8.031},
    # a stall soon after the load began: four labels crowd the left of the plot
    "early": {"soak load started": 1.784, "stall onset (last progress)": 2.0, "stall detected": 2.5,
              "soak duration reached": 2.9},
    # a stall at the very end: the labels would run past the right edge
    "late": {"soak load started": 1.784, "stall onset (last progress)": 8.6, "stall detected": 9.0},
    "healthy": {"soak load started": 1.784, "soak duration reached": 9.05},
}


def _bundle(marks: dict[str, float]) -> Bundle:
    bundle = Bundle.model_validate(json.loads(BUNDLE.read_text()))
    timeline = [e for e in bundle.timeline if e.event not in _SOAK_EVENTS]
    timeline += [TimelineEvent(t=t, event=name) for name, t in marks.items()]
    bundle.timeline = sorted(timeline, key=lambda e: e.t)
    assert bundle.soak is not None
    stop = marks.get("stall onset (last progress)", 99.0)
    start = marks["soak load started"]
    series, tokens, t = [], 0, start
    while t <= 9.05:   # the client's counters every 0.5 s: 400 tok/s until the last token
        rate = 400.0 if t <= stop else 0.0
        tokens += int(rate * 0.5)
        series.append(SoakSample(t=round(t, 3), tokens=tokens, tokens_per_s=rate, in_flight=16))
        t += 0.5
    bundle.soak.series = series
    bundle.soak.stalled = "stall detected" in marks
    return bundle


def _page(tmp_path: Path, name: str) -> tuple[Path, str]:
    bundle = _bundle(LAYOUTS[name])
    out = tmp_path / name
    out.mkdir()
    paths = write_view(out, run_view(bundle, diagnose(bundle), out_dir=out, command="soak"))
    page = paths["report.html"]
    return page, page.read_text().split('id="kvdiag-report"')[0]   # the page, not its embedded JSON


def _plots(html: str) -> dict[str, tuple[str, ET.Element]]:
    """Each soak plot's caption and its svg, parsed, by the figure's id."""
    section = html.split('<section id="soak">', 1)[1].split("</section>", 1)[0]
    out = {}
    for fig in re.findall(r'<figure id="(soak-plot-\w+)".*?</figure>', section, re.S):
        body = section.split(f'<figure id="{fig}"', 1)[1].split("</figure>", 1)[0]
        caption = re.sub(r"<[^>]+>", "", "<figcaption" + body.split("<figcaption", 1)[1].split("</figcaption>", 1)[0])
        svg = re.search(r"<svg.*?</svg>", body, re.S)
        assert svg is not None, f"{fig} draws nothing: {body[:300]}"
        out[fig] = (caption, ET.fromstring(svg.group(0)))
    return out


def _texts(svg: ET.Element, cls: str) -> list[str]:
    return [t.text or "" for t in svg.iter(f"{SVG}text") if t.get("class") == cls]


def _x_of(t: float, marks: dict[str, float], bundle: Bundle) -> float:
    t0 = marks["soak load started"]
    t1 = max([m.t for m in bundle.metrics] + list(marks.values()))
    return PLOT_LEFT + (t - t0) / (t1 - t0) * (PLOT_RIGHT - PLOT_LEFT)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_plot_names_its_measure_its_units_and_the_stall(name: str, tmp_path: Path) -> None:
    _, html = _page(tmp_path, name)
    plots = _plots(html)
    assert list(plots) == ["soak-plot-tokens", "soak-plot-kv", "soak-plot-requests"]
    want = {"soak-plot-tokens": (("tokens per second",), "tok/s"),
            "soak-plot-kv": (("KV cache usage",), "% of pool"),
            "soak-plot-requests": (("requests", "running", "waiting"), "requests")}
    marks = LAYOUTS[name]
    bundle = _bundle(marks)
    for fig, (caption, svg) in plots.items():
        words, unit = want[fig]
        assert all(w in caption for w in words), (fig, caption)
        assert _texts(svg, "unit") == [unit], fig                         # the y axis says its unit
        xs = _texts(svg, "xtick")                                          # the x axis: seconds of load
        assert xs[0] == "0 s" and len(xs) >= 3 and all(re.fullmatch(r"\d+ s", x) for x in xs), (fig, xs)
        ys = _texts(svg, "ytick")
        assert len(ys) == 3 and ys[0].startswith("0"), (fig, ys)
        if fig == "soak-plot-kv":
            assert ys == ["0 %", "50 %", "100 %"]
        series = {(p.find(f"{SVG}title").text or "") for p in svg.iter(f"{SVG}path")}   # type: ignore[union-attr]
        if fig == "soak-plot-requests":
            assert {"running (server)", "waiting (server)"} <= series, series
        for p in svg.iter(f"{SVG}path"):   # every point inside the plot area: none over the axis labels
            nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", p.get("d", ""))]
            assert all(PLOT_LEFT - 0.05 <= x <= PLOT_RIGHT + 0.05 for x in nums[0::2]), (fig, p.get("d"))
            assert all(PLOT_TOP - 0.05 <= y <= PLOT_BOTTOM + 0.05 for y in nums[1::2]), (fig, p.get("d"))
        lines = {(ln.find(f"{SVG}title").text or ""): float(ln.get("x1", "nan"))   # type: ignore[union-attr]
                 for ln in svg.iter(f"{SVG}line") if "markline" in (ln.get("class") or "")}
        labels = _texts(svg, "marklabel")
        assert sorted(labels) == sorted(lines), (fig, labels, lines)
        if "stall detected" in marks:   # the stall marked where it was detected, in red
            assert lines["stall detected"] == pytest.approx(_x_of(marks["stall detected"], marks, bundle), abs=0.1)
            stall = next(ln for ln in svg.iter(f"{SVG}line") if "markline bad" == ln.get("class"))
            assert float(stall.get("x1", "nan")) == lines["stall detected"]
            assert "last token" in lines
        else:
            assert "stall detected" not in lines and "duration reached" in lines


_BOXES = """JSON.stringify([...document.querySelectorAll('#soak svg.plot')].map(svg => {
  const frame = svg.getBoundingClientRect();
  const boxes = [...svg.querySelectorAll('text')].map(t => {
    const r = t.getBoundingClientRect();
    return {text: t.textContent, cls: t.getAttribute('class'), l: r.left - frame.left, r: r.right - frame.left,
            t: r.top - frame.top, b: r.bottom - frame.top};
  });
  return {id: svg.closest('figure').id, w: frame.width, h: frame.height, boxes};
}))"""


def test_no_label_is_drawn_over_another_in_a_browser(tmp_path: Path) -> None:
    browser = chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    for name in LAYOUTS:
        page, _ = _page(tmp_path, name)
        plots = evaluate(browser, page, _BOXES, tmp_path / f"{name}-browser")
        assert isinstance(plots, list) and len(plots) == 3, plots
        for plot in plots:
            boxes = plot["boxes"]
            assert any(b["cls"] == "marklabel" for b in boxes), plot
            for b in boxes:   # inside the svg (a label past its edge is cut off)
                assert b["l"] >= -0.5 and b["r"] <= plot["w"] + 0.5 and b["t"] >= -0.5 and b["b"] <= plot["h"] + 0.5, \
                    (name, plot["id"], b)
            for i, a in enumerate(boxes):
                for b in boxes[i + 1:]:
                    apart = a["r"] <= b["l"] or b["r"] <= a["l"] or a["b"] <= b["t"] or b["b"] <= a["t"]
                    assert apart, (name, plot["id"], a, b)
