"""Hang signatures: stable across captures and tools, matched to known upstream defects."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.analyze.known import KNOWN
from kvdiag.analyze.overall import analyze
from kvdiag.analyze.signature import canonical_name, hang_signature, signature_groups
from kvdiag.bundle.io import load_bundle
from kvdiag.capture.parsers import parse_pystack
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.kinds import ProcessRole, ThreadState, VerdictKind
from kvdiag.model.verdict import EvidenceItem, Verdict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BUNDLES = FIXTURES / "bundles"
SEED_SIGNATURE = "gil_cycle-3716a34488aa"


def _verdict(name: str) -> tuple[Verdict, Bundle]:
    bundle, _ = load_bundle(BUNDLES / name)
    return analyze(bundle), bundle


def seed_bundle() -> Bundle:
    """The seed's EngineCore stacks (tests/fixtures/seed/) through kvdiag's own pystack parser."""
    threads, _ = parse_pystack((FIXTURES / "seed" / "issue371_pystack.txt").read_text(encoding="utf-8"))
    for t in threads:
        t.state = ThreadState.SLEEPING   # the seed: every thread in futex_wait_queue, CPU 0
    proc = ProcessEvidence(pid=48213, role=ProcessRole.ENGINE_CORE, comm="VLLM::EngineCor", threads=threads,
                           python_version="3.12")
    return Bundle(processes=[proc])


@pytest.mark.parametrize(("ref_name", "name"), [("gil_cycle", "gil_cycle_stripped"),
                                                 ("gil_cycle", "gil_cycle_no_pystack"),
                                                 ("lock_inversion", "lock_inversion_no_pystack")])
def test_same_hang_same_signature_whatever_the_tools_or_symbols(ref_name: str, name: str) -> None:
    ref, _ = _verdict(ref_name)
    other, _ = _verdict(name)
    assert ref.signature is not None and ref.signature == other.signature
    assert ref.evidence[0].pid != other.evidence[0].pid   # different captures, different pids


def test_different_hangs_sign_differently_and_healthy_has_none() -> None:
    verdicts = [_verdict(n)[0] for n in ("gil_cycle", "lock_inversion", "lost_wakeup", "ipc_read")]
    assert len({v.signature for v in verdicts}) == 4
    assert all(v.signature is not None and v.signature.startswith(v.kind.value + "-") for v in verdicts)
    healthy, _ = _verdict("healthy_idle")
    assert healthy.kind is VerdictKind.HEALTHY and healthy.signature is None and healthy.known is None


def test_signature_ignores_pids_addresses_lines_and_thread_order() -> None:
    def item(pid: int, tid: int, frames: list[str]) -> EvidenceItem:
        return EvidenceItem(pid=pid, tid=tid, role="r", frames=frames)

    a = Verdict(kind=VerdictKind.GIL_CYCLE, summary="", evidence=[
        item(1, 1, ["pthread_cond_wait@@GLIBC_2.3.2 (pthread_cond_wait.c:618)",
                    "kvcached::PageAllocator::alloc_page() (page_allocator.cpp:143)",
                    "_alloc (kv_cache_manager.py:9)"]),
        item(1, 2, ["take_gil (ceval_gil.h:231)", "kvcached::PageAllocator::map_pages(std::vector<long> const&) "
                    "(page_allocator.cpp:455)", "kvcached::PageAllocator::prealloc_worker() (page_allocator.cpp:1)"])])
    b = Verdict(kind=VerdictKind.GIL_CYCLE, summary="", evidence=[
        item(99, 7, ["take_gil (libpython3.12.so)", "kvcached::PageAllocator::map_pages(std::vector<long> const&) "
                     "(vmm_ops.so)", "kvcached::PageAllocator::prealloc_worker() (vmm_ops.so)"]),
        item(99, 99, ["pthread_cond_wait (libc.so.6)", "kvcached::PageAllocator::alloc_page() (vmm_ops.so)"])])
    assert hang_signature(a) == hang_signature(b) == SEED_SIGNATURE
    c = b.model_copy(update={"kind": VerdictKind.LOST_WAKEUP})
    assert hang_signature(c) != hang_signature(b)


def test_canonical_names() -> None:
    assert canonical_name("kvcached::PageAllocator::map_pages(std::vector<long, std::allocator<long> > const&)") \
        == "PageAllocator::map_pages"
    assert canonical_name("pthread_cond_wait@@GLIBC_2.3.2") == "pthread_cond_wait"
    assert canonical_name("<module>") == "<module>"
    assert canonical_name("foo.constprop.0") == "foo"


def test_seed_stacks_are_the_prealloc_gil_cycle_of_371() -> None:
    bundle = seed_bundle()
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.GIL_CYCLE
    assert signature_groups(verdict, bundle) == [("PageAllocator::alloc_page",),
                                                 ("PageAllocator::map_pages", "PageAllocator::prealloc_worker")]
    assert verdict.signature == SEED_SIGNATURE
    assert verdict.known is not None and verdict.known.id == "kvcached#371" and verdict.known.match == "signature"
    assert verdict.known.line() == ("known: kvcached#371 (" + verdict.known.title + "); fixed by PR #422 (666671b), "
                                    "first in 0.1.6")
    assert SEED_SIGNATURE in KNOWN[0].signatures


def test_hanger_gil_cycle_matches_371_by_pattern() -> None:
    verdict, _ = _verdict("gil_cycle")
    assert verdict.known is not None and verdict.known.id == "kvcached#371" and verdict.known.match == "pattern"
    ctypes_only, _ = _verdict("gil_cycle_ctypes")   # a GIL cycle, but not kvcached's frames
    assert ctypes_only.kind is VerdictKind.GIL_CYCLE and ctypes_only.known is None


def test_blocked_worker_ipc_read_is_the_ipc_half_of_371() -> None:
    v = Verdict(kind=VerdictKind.BLOCKED_IPC_READ, summary="", evidence=[EvidenceItem(pid=5, tid=5, role="r", frames=[
        "epoll_wait (libc.so.6)", "select (selectors.py:468)", "_run_once (base_events.py:1898)",
        "_send_and_receive_message (tp_ipc_util.py:120)", "broadcast_map_to_kv_tensors (tp_ipc_util.py:160)"])])
    from kvdiag.analyze.signature import sign

    sign(v)
    assert v.signature is not None and v.signature.startswith("blocked_ipc_read-")
    assert v.known is not None and v.known.id == "kvcached#371" and "KVCACHED_IPC_TIMEOUT" in (v.known.fixed_by or "")


def test_alloc_page_holding_the_gil_while_blocked_is_the_gil_half_of_371() -> None:
    from kvdiag.analyze.signature import sign

    v = Verdict(kind=VerdictKind.GIL_HELD_BLOCKED, summary="", evidence=[EvidenceItem(pid=5, tid=5, role="r", frames=[
        "pthread_cond_wait (libc.so.6)", "kvcached::PageAllocator::alloc_page() (vmm_ops.so)",
        "_alloc (kv_cache_manager.py:205)"])])
    sign(v)
    assert v.signature is not None and v.signature.startswith("gil_held_blocked-")
    assert v.known is not None and v.known.id == "kvcached#371" and "GIL half" in v.known.title


def test_soak_stall_with_the_seed_cycle_is_reproduction_b_of_371() -> None:
    verdict, bundle = _verdict("soak_gil_cycle")
    assert verdict.kind is VerdictKind.DECODE_STALL
    assert signature_groups(verdict, bundle) == [("PageAllocator::alloc_page",),
                                                 ("PageAllocator::map_pages", "PageAllocator::prealloc_worker")]
    assert verdict.known is not None and verdict.known.id == "kvcached#371"
    assert "stall under load" in verdict.known.title
