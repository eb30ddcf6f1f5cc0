"""The cross-process analyzer on saved captures of the cross-process corpus (tests/fixtures/bundles/xproc).

Saved from real captures (/proc and py-spy, as tests/integration/test_xproc_corpus.py captures) of the
programs in tests/fixtures/hangers/xproc.py; the expected verdict, chain and root come from how each
program was written (hanger_kit.KINDS), never from the analyzer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvdiag.analyze.diagnosis import diagnose, exit_code_for
from kvdiag.analyze.overall import analyze
from kvdiag.bundle.io import load_bundle
from kvdiag.capture.merge import bundle_without_tool
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import VerdictKind
from kvdiag.model.verdict import Diagnosis

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
XPROC = FIXTURES / "bundles" / "xproc"
sys.path.insert(0, str(FIXTURES / "hangers"))
import hanger_kit as hk  # noqa: E402

NAMES = sorted(p.name for p in XPROC.iterdir() if (p / "bundle.json").is_file())


def load(name: str) -> Bundle:
    return load_bundle(XPROC / name)[0]


def test_every_cross_process_program_has_a_saved_capture() -> None:
    assert set(NAMES) == {k for k, spec in hk.KINDS.items() if spec.xproc}


@pytest.mark.parametrize("name", NAMES)
def test_saved_capture_is_named_at_the_root_of_its_chain(name: str) -> None:
    spec = hk.KINDS[name]
    verdict = analyze(load(name))
    assert verdict.kind.value == spec.expect, verdict.summary
    assert exit_code_for(verdict) == (10 if spec.hangs else 0)
    w = verdict.waits
    if not spec.hangs:
        assert w is None, verdict.summary
        return
    assert w is not None and [e.kind.value for e in w.edges][-len(spec.chain):] == list(spec.chain), w
    assert all(a.dst.pid == b.src.pid for a, b in zip(w.edges, w.edges[1:], strict=False))
    assert w.cycle is (spec.ends == "cycle") and w.lost_message is (spec.ends == "lost")
    if spec.ends != "cycle":
        assert w.root is not None and w.root.pid == w.edges[-1].dst.pid
        assert any(spec.root_frame in f for f in w.root_frames) and w.root_key_frames, w.root_frames


@pytest.mark.parametrize("name", NAMES)
def test_the_stored_diagnosis_round_trips_with_its_graph(name: str) -> None:
    diag = diagnose(load(name))
    again = Diagnosis.model_validate_json(diag.model_dump_json())
    assert again == diag
    if hk.KINDS[name].hangs:
        assert again.wait_graph is not None and again.verdict.waits is not None
        assert {e.kind for e in again.verdict.waits.edges} <= {e.kind for e in again.wait_graph.edges}


def test_without_the_followed_peer_the_chain_ends_at_it_and_the_hang_stands() -> None:
    """What --no-follow would have captured: the REP server outside the tree is missing."""
    bundle = load("xproc_zmq_outside")
    followed = [p.pid for p in bundle.processes if p.followed_from]
    assert followed, "the REP server was captured by following the client's ZMQ connection"
    bundle.processes = [p for p in bundle.processes if not p.followed_from]
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.BLOCKED_IPC_READ and verdict.waits is not None
    assert verdict.waits.root_state == "not_captured" and verdict.waits.root is not None
    assert verdict.waits.root.pid == followed[0] and "not captured" in verdict.summary


@pytest.mark.parametrize("name", [n for n in NAMES if not hk.KINDS[n].hangs])
def test_a_healthy_look_alike_is_never_a_deadlock_without_proc(name: str) -> None:
    assert not analyze(bundle_without_tool(load(name), "proc")).kind.is_hang
