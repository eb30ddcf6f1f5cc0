"""vLLM's shared-memory rings: geometry from the segment size, flags read through a real mapping, and the
recogniser that turns a spinning reader into a wait on the other side of its ring."""

from __future__ import annotations

import os
from multiprocessing import shared_memory
from pathlib import Path

from kvdiag.analyze.diagnosis import diagnose
from kvdiag.analyze.xproc import CrossProcess
from kvdiag.bundle.io import load_bundle
from kvdiag.capture import vllmrings
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import ProcessRole, VerdictKind
from kvdiag.model.waits import EdgeKind
from kvdiag.osread.maps import shared_file_mappings
from kvdiag.osread.shmring import ring_geometry

MIB = 1024 * 1024


def test_ring_geometry_of_vllms_queues() -> None:
    # Sizes seen on a TP=2 vLLM CPU engine: a worker's response ring, the broadcast ring, the TP group's ring.
    resp, bcast, group = ring_geometry(251658260), ring_geometry(167772190), ring_geometry(25165836)
    assert resp is not None and (resp.n_reader, resp.max_chunk_bytes, resp.max_chunks) == (1, 24 * MIB, 10)
    assert bcast is not None and (bcast.n_reader, bcast.max_chunk_bytes, bcast.max_chunks) == (2, 16 * MIB, 10)
    assert group is not None and (group.n_reader, group.max_chunk_bytes, group.max_chunks) == (1, 4 * MIB, 6)


def test_ring_flags_read_through_the_mapping_at_both_ends() -> None:
    size = (MIB + 1 + 2) * 10    # 2 readers, 1 MiB chunks, 10 slots
    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        meta = MIB * 10
        shm.buf[meta:meta + 3] = bytes([1, 1, 0])          # slot 0 written, read by reader 0 only
        maps = shared_file_mappings(os.getpid())
        w = vllmrings.begin(os.getpid(), maps)
        shm.buf[meta + 2] = 1                              # reader 1 reads it during the window
        rings = vllmrings.finish(w)
        assert rings is not None
        ring = next(r for r in rings if r.path.endswith(shm.name))
        assert ring.geometry.n_reader == 2 and ring.before[0] == [1, 1, 0] and ring.after[0] == [1, 1, 1]
        assert ring.advanced is True and ring.unread_by(1) == 0 and not ring.full()
    finally:
        shm.close()
        shm.unlink()


FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "vllm_tp2_stuck_rank"


def _tp2_bundle() -> Bundle:
    loaded = load_bundle(FIXTURE)
    return loaded[0] if isinstance(loaded, tuple) else loaded


def _titled(bundle: Bundle) -> dict[str, int]:
    return {(p.cmdline[0] if p.cmdline else "").strip("\0 "): p.pid for p in bundle.processes}


def test_tp2_stuck_rank_and_the_chain_from_the_api_server() -> None:
    """A real TP=2 capture: rank 1 in the GIL cycle, rank 0 spinning at 100 % in the all-reduce, the EngineCore
    napping in its ring loop, the API server in its event loop with a request in flight."""
    bundle = _tp2_bundle()
    t = _titled(bundle)
    api = next(p.pid for p in bundle.processes if p.role is ProcessRole.API_SERVER)
    verdict = diagnose(bundle).verdict
    assert verdict.kind is VerdictKind.GIL_CYCLE
    assert f"pid {t['VLLM::Worker_TP1']} (Worker_TP1 of engine tp2)" in verdict.summary
    assert verdict.waits is not None and verdict.waits.root is not None
    assert [n.pid for n in verdict.waits.nodes()] == [api, t["VLLM::EngineCore"], t["VLLM::Worker_TP0"],
                                                      t["VLLM::Worker_TP1"]]
    assert [e.kind for e in verdict.waits.edges] == [EdgeKind.ZMQ, EdgeKind.SHM_RING, EdgeKind.COLLECTIVE]
    assert verdict.waits.root_state == "hung" and verdict.waits.root.pid == t["VLLM::Worker_TP1"]
    ring = verdict.waits.edges[1].evidence
    assert ring.mapping and "/dev/shm/psm_" in ring.mapping and "nothing unread" in ring.text


def test_a_ring_whose_flags_moved_is_progress_not_a_wait() -> None:
    bundle = _tp2_bundle()
    core = next(p for p in bundle.processes if p.role is ProcessRole.ENGINE_CORE)
    assert core.shm_rings
    ring = core.shm_rings[0]
    ring.after = [[1, 0] if i == 0 else slot for i, slot in enumerate(ring.before)]   # a new answer was written
    g = CrossProcess(bundle)
    key = (core.node, core.pid)
    assert not g.deps.get((key, core.pid))
    assert g.root_of(key).state == "running"


def test_a_log_the_engines_processes_share_is_no_ones_progress() -> None:
    """vLLM's API server logs every /health into the log its EngineCore and workers write too: the stuck rank
    is still the root while that file grows."""
    bundle = _tp2_bundle()
    log = "/tmp/run/tp2.log"
    for p in bundle.processes:
        p.log_files = [log]
        if p.progress is not None:
            p.progress.log_growth = {log: 237}
    verdict = diagnose(bundle).verdict
    assert verdict.waits is not None and verdict.waits.root_state == "hung", verdict.summary
