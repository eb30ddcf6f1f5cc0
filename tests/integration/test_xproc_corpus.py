"""Hangs that cross a process boundary, captured for real with `kvdiag capture --pid`, named at their root.

Each program of the cross-process corpus (tests/fixtures/hangers/xproc.py, hanger_kit.KINDS[...].xproc)
is started, parks where it hangs (or idles, for the healthy look-alikes), and is captured the way a
user does (the CLI, /proc and py-spy). The expected verdict comes from how the program was written;
the chain (Verdict.waits) must lead from the first waiter to the root, and the root's frames be cited.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

HANGERS = Path(__file__).resolve().parents[1] / "fixtures" / "hangers"
sys.path.insert(0, str(HANGERS))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hanger_kit as hk  # noqa: E402
from kvcli import run_kvdiag  # noqa: E402

pytestmark = pytest.mark.timeout(180)

XPROC = [k for k, spec in hk.KINDS.items() if spec.xproc]
def capture(kind: str, tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    why = hk.available(kind)
    if why is not None:
        pytest.skip(why)
    with hk.running(kind, bound_s=90) as h:
        done = run_kvdiag("capture", "--pid", str(h.root_pid), "--out", str(tmp_path / "run"), "--tools",
                          "proc,py-spy", "--json", *extra, timeout=120)
    assert done.returncode in (0, 10), done.stdout + done.stderr
    return done.returncode, json.loads(done.stdout)["verdict"]


@pytest.mark.parametrize("kind", XPROC)
def test_cross_process_program_is_named_at_the_root_of_its_chain(kind: str, tmp_path: Path) -> None:
    spec = hk.KINDS[kind]
    code, verdict = capture(kind, tmp_path)
    assert verdict["kind"] == spec.expect, f"{kind} ({spec.shape}): {verdict['summary']}"
    assert code == (10 if spec.hangs else 0)
    waits = verdict.get("waits")
    if not spec.hangs:
        assert waits is None, verdict["summary"]
        return
    assert waits is not None and waits["edges"], verdict["summary"]
    kinds, end = list(spec.chain), spec.ends
    assert [e["kind"] for e in waits["edges"]][-len(kinds):] == kinds, waits["edges"]
    for a, b in zip(waits["edges"], waits["edges"][1:], strict=False):
        assert a["dst"]["pid"] == b["src"]["pid"]                  # one chain, process to process
    assert all(e["evidence"]["frames"] for e in waits["edges"])     # each edge cites the waiter's frames
    if end == "cycle":
        assert waits["cycle"] and waits["edges"][-1]["dst"]["pid"] == waits["edges"][0]["src"]["pid"]
        assert "cycle" in verdict["summary"]
        return
    assert waits["root"] is not None and waits["edges"][-1]["dst"]["pid"] == waits["root"]["pid"]
    assert waits["lost_message"] is (end == "lost")
    if end == "lost":
        assert "message was lost" in verdict["summary"]
    frames = waits["root_frames"]
    assert frames and waits["root_key_frames"], waits
    assert any(spec.root_frame in f for f in frames), frames


def test_a_peer_outside_the_tree_is_followed_or_named(tmp_path: Path) -> None:
    """The REP server is no descendant of the client: followed, it is captured and named as the root;
    without following, the chain ends at it, named as not captured, and the hang is still called."""
    code, verdict = capture("xproc_zmq_outside", tmp_path / "follow")
    report = json.loads((tmp_path / "follow" / "run" / "report.json").read_text())
    assert code == 10 and verdict["waits"]["root_state"] == "parked", verdict["summary"]
    assert any(f["kind"] == "followed_peer" for f in report["findings"]), report["findings"]
    code, verdict = capture("xproc_zmq_outside", tmp_path / "nofollow", "--no-follow")
    assert code == 10 and verdict["waits"]["root_state"] == "not_captured", verdict["summary"]
    assert "not captured" in verdict["summary"]
    html = (tmp_path / "nofollow" / "run" / "report.html").read_text()
    assert 'id="chain"' in html and "waits on ZMQ for" in html
