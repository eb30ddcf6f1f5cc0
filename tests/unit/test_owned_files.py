"""The rule for what kvdiag may remove, with real processes and real /dev/shm files: a file goes only when a
process kvdiag started was seen holding it and nobody holds it now, both judged by (device, inode)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdiag.launch.owned import OwnedFiles, run_processes, sweep_shm
from kvdiag.launch.reaper import group_is_ours, leader_start
from kvdiag.osread.holders import file_id, held_ids, mapped_ids

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")

# An "engine": makes a SharedMemory block and a spawn-start lock, says their names, parks (bounded).
ENGINE = """
import multiprocessing, sys, time
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(create=True, size=4096)
lock = multiprocessing.get_context("spawn").Lock()
print(shm.name, lock._semlock.name, flush=True)
time.sleep(60)
"""


def test_a_live_semaphore_is_held_by_identity_though_its_mapping_names_another_file() -> None:
    since = time.time()
    lock = multiprocessing.get_context("spawn").Lock()   # sem.mp-* kept by name for spawned children
    name = lock._semlock.name.lstrip("/")   # type: ignore[attr-defined]
    path = SHM / f"sem.{name}"
    fid = file_id(str(path))
    assert fid is not None
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert str(path) not in maps   # glibc mapped it under a temporary name: by name nobody holds it
    assert fid in (mapped_ids(os.getpid(), {fid[0]}) or set())
    swept = sweep_shm(since, {fid})   # even if the run had been seen holding it: a live holder keeps it
    assert path.exists() and f"sem.{name}" not in swept.removed + swept.left


def test_an_engines_files_are_seen_while_it_runs_and_removed_once_it_is_killed() -> None:
    since = time.time()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    files: list[Path] = []
    try:
        assert engine.stdout is not None
        shm_name, sem_name = engine.stdout.readline().split()
        files += [SHM / shm_name.lstrip("/"), SHM / f"sem.{sem_name.lstrip('/')}"]
        owned = OwnedFiles()
        start = leader_start(engine.pid)
        assert group_is_ours(engine.pid, start, None) and not group_is_ours(engine.pid, (start or 0) + 1, None)
        tree = run_processes([engine.pid])
        assert engine.pid in tree and len(tree) >= 2   # the engine and its resource tracker
        owned.observe(tree)
        ids = {file_id(str(p)) for p in files}
        assert ids <= owned.seen
        assert sweep_shm(since, owned.seen).removed == []   # still held by the engine: nothing goes
        os.killpg(engine.pid, signal.SIGKILL)   # engine and tracker together: nobody unlinks them
        engine.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(held_ids(p, owned.devs) for p in tree if p != engine.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.exists() for p in files)
        swept = sweep_shm(since, owned.seen)
        assert sorted(swept.removed) == sorted(p.name for p in files)
        assert not any(p.exists() for p in files)
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
            engine.wait(timeout=10)
        for p in files:   # this test's own engine's files, should the sweep have failed
            p.unlink(missing_ok=True)


def test_a_group_is_signalled_only_while_its_leader_is_the_process_kvdiag_started() -> None:
    from kvdiag.launch.reaper import kill_groups

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        start = leader_start(proc.pid)
        assert start is not None
        kill_groups({proc.pid: start + 1}, None, grace_s=0.2)   # the number, another process's start time
        assert proc.poll() is None
        kill_groups({proc.pid: start}, None, grace_s=5)
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
