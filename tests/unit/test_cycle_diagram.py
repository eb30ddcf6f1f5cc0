"""The wait-for cycle diagram keeps every word of a node's label in its box, and its legend reads both
kinds of arrow it draws."""

from __future__ import annotations

import json
from pathlib import Path

from kvdiag.report.html import cycle_diagram

BUNDLE = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "vllm_two_engine_stock" / "bundle.json"


def test_every_word_of_each_label_is_in_its_box() -> None:
    cycle = json.loads(BUNDLE.read_text())["diagnosis"]["verdict"]["cycle"]
    assert any("alloc_page" in label for label in cycle)
    diagram = cycle_diagram(cycle)
    assert diagram is not None
    for node in diagram.nodes:
        assert " ".join(node.lines).split() == node.title.split()        # nothing cut, no "…"
        assert 14 * len(node.lines) + 4 <= node.h                        # the lines fit the box's height
        assert all(len(line) <= 30 for line in node.lines)               # and its width (230 px at 12 px)
        assert node.y >= 0 and node.y + node.h <= diagram.height


def test_the_legend_reads_held_by_as_well_as_waits_for() -> None:
    cycle = json.loads(BUNDLE.read_text())["diagnosis"]["verdict"]["cycle"]
    diagram = cycle_diagram(cycle)
    assert diagram is not None
    labels = {e.label for e in diagram.edges}
    assert labels == {"held by", "waits for"}
    page = (Path(__file__).resolve().parents[2] / "kvdiag" / "report" / "templates" / "report.html.j2").read_text()
    legend = page.split('<section id="cycle">', 1)[1].split("<svg", 1)[0]
    assert '"held by"' in legend and '"waits for"' in legend
