"""The GIL-cycle verdict names the thread that can wake the holder: the prealloc worker in map_pages.

tests/fixtures/bundles/soak_gil_cycle/bundle.json is the bundle of a real `kvdiag soak --duration 30`
(stock allocator, embedded soak-hybrid scenario, simulated engine): in EngineCore, MainThread holds
the GIL in alloc_page, and two threads wait for it: the prealloc worker (in map_pages, the only one
that can signal alloc_page's condition variable) and process_output_sockets (in queue.get, a Python
thread that merely queues for the GIL). Whatever the order the threads were captured in, the verdict,
its evidence and its cycle cite the prealloc worker, as repro's do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdiag.analyze.overall import analyze
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import VerdictKind

BUNDLE = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "soak_gil_cycle" / "bundle.json"
PREALLOC_TID, OUTPUT_TID = 1757, 1759


def load(order: str) -> Bundle:
    data = json.loads(BUNDLE.read_text())
    core = next(p for p in data["processes"] if p["role"] == "engine_core")
    if order == "reversed":
        core["threads"].reverse()
    elif order == "output_first":
        core["threads"].sort(key=lambda t: t["tid"] != OUTPUT_TID)
    return Bundle.model_validate(data)


@pytest.mark.parametrize("order", ["captured", "reversed", "output_first"])
def test_soak_gil_cycle_cites_the_prealloc_worker_in_map_pages(order: str) -> None:
    verdict = analyze(load(order))
    assert verdict.kind is VerdictKind.DECODE_STALL
    assert "prealloc_worker" in verdict.summary and "map_pages" in verdict.summary, verdict.summary
    assert "process_output_sockets" not in verdict.summary
    waiter = verdict.evidence[1]
    assert waiter.tid == PREALLOC_TID and waiter.role.startswith("prealloc worker in map_pages")
    assert any("map_pages" in f for f in waiter.frames)
    assert any(f"thread {PREALLOC_TID}" in node and "map_pages" in node for node in verdict.cycle), verdict.cycle
    assert not any(f"thread {OUTPUT_TID}" in node for node in verdict.cycle)
