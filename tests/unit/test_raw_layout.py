"""One raw layout for every command (kvdiag.bundle.io.raw_dir), and bundles in the older layout stay readable.

Until this layout, repro/ab/soak wrote ``raw/<engine>/<pid>/`` while capture wrote ``raw/<pid>/``; a
bundle saved then must still load and render its raw tool outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.bundle.io import load_run, raw_dir, raw_root, save_bundle
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence, ToolRun
from kvdiag.model.run import EngineRecord
from kvdiag.report.html import raw_outputs


def test_raw_dir_is_raw_pid(tmp_path: Path) -> None:
    assert raw_dir(raw_root(tmp_path), 4242) == tmp_path / "raw" / "4242"


@pytest.mark.parametrize("rel", ["raw/eng/123/py-spy.txt",   # repro/ab/soak before the one layout
                                 "raw/123/py-spy.txt"])      # the one layout (capture always)
def test_a_bundle_in_either_layout_loads_and_renders_its_raw_outputs(tmp_path: Path, rel: str) -> None:
    bundle_dir = tmp_path / "out" / "bundle"
    (bundle_dir / rel).parent.mkdir(parents=True)
    (bundle_dir / rel).write_text('Thread 123 (idle): "MainThread"\n    alloc_page (kvcached/alloc.py:7)\n')
    save_bundle(Bundle(command="repro two-engine", engines=[EngineRecord(name="eng")],
                       processes=[ProcessEvidence(pid=123, engine="eng",
                                                  tools=[ToolRun(tool="py-spy", ok=True, raw_path=rel)])]),
                bundle_dir)
    run = load_run(tmp_path / "out")
    assert run.bundle_dir == bundle_dir
    assert run.bundle.processes[0].tools[0].raw_path == rel
    outputs = {o["path"]: o for o in raw_outputs(run.bundle, run.bundle_dir)}
    assert outputs[rel]["text"] is not None and "alloc_page" in outputs[rel]["text"]
    assert outputs[rel]["note"] is None
