"""Out-of-process reaper: kills everything kvdiag started once kvdiag is gone.

kvdiag starts it in its own session and keeps a pipe to its stdin. kvdiag writes
``+PGID`` / ``-PGID`` lines as it starts and reaps engines. When the pipe
reaches EOF — kvdiag exited, crashed or was SIGKILLed — the reaper SIGTERMs
every registered process group, SIGKILLs what is left after a grace period, and
sweeps any process whose environment carries ``KVDIAG_RUN_ID=<run id>`` (a
child that left its process group), then removes the private temp folders
registered with ``dir PATH`` (raw, unredacted engine logs must not outlive a
killed kvdiag) and the run's own modelled-device files in /dev/shm. It ignores SIGINT/SIGTERM/SIGHUP so a
Ctrl-C or a terminal hang-up cannot stop it before it has cleaned up.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable

from kvdiag.osread.fds import fd_links
from kvdiag.osread.maps import read_maps
from kvdiag.osread.process import read_environ
from kvdiag.osread.ptable import alive, group_alive
from kvdiag.osread.stat import all_pids

RUN_ID_ENV = "KVDIAG_RUN_ID"


def pids_with_marker(run_id: str) -> list[int]:
    """Pids whose environment holds KVDIAG_RUN_ID=run_id (zombies excluded)."""
    me = os.getpid()
    return [pid for pid in all_pids()
            if pid != me and (read_environ(pid) or {}).get(RUN_ID_ENV) == run_id and alive(pid)]


def kill_groups(pgids: Iterable[int], run_id: str | None, grace_s: float) -> None:
    """SIGTERM the groups (and marked stragglers), wait up to grace_s, then SIGKILL."""
    groups = [g for g in set(pgids) if g > 1 and g != os.getpgrp()]
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    strays = pids_with_marker(run_id) if run_id else []
    for pid in strays:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not any(group_alive(g) for g in groups) and not (run_id and pids_with_marker(run_id)):
            return
        time.sleep(0.05)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if run_id:
        for pid in pids_with_marker(run_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


SHM_DIR = "/dev/shm"
# multiprocessing.shared_memory segments (vLLM's broadcast queues, psm_<hex>) and multiprocessing's named
# semaphores (sem.mp-<id>), left behind when their owner and its resource tracker are killed together.
# They cannot be redirected to the run's folder, so they are swept instead.
SHM_PREFIXES = ("psm_", "sem.mp-")
# vLLM CPU's tensor-parallel all-reduce segments, ``<ident>-<group>-cpushm_<rank>``, named after the
# rendezvous file ``$TMPDIR/vllm_dist_<hex>`` of the engine (its VLLM_DIST_IDENT). vLLM never unlinks them,
# not even on a clean shutdown. The run's own are known exactly from the files in its TMPDIR.
VLLM_DIST_PREFIX = "vllm_dist_"


def vllm_dist_idents(folders: Iterable[str | os.PathLike[str]]) -> list[str]:
    """The ``vllm_dist_<hex>`` rendezvous names in the given run folders (and their ``tmp`` subfolder):
    the prefixes of the /dev/shm segments those engines created."""
    found: list[str] = []
    for folder in folders:
        for where in (os.fspath(folder), os.path.join(os.fspath(folder), "tmp")):
            try:
                names = os.listdir(where)
            except OSError:
                continue
            found += [n for n in names if n.startswith(VLLM_DIST_PREFIX) and n not in found]
    return found


def _shm_in_use() -> set[str]:
    """Names under /dev/shm some live process maps or holds open."""
    used: set[str] = set()
    marker = SHM_DIR + "/"
    for pid in all_pids():
        for m in read_maps(pid) or []:
            at = m.path.find(marker)
            if at >= 0:
                used.add(m.path[at + len(marker):].split(" ")[0])
        used.update(link[len(marker):] for link in (fd_links(pid) or {}).values() if link.startswith(marker))
    return used


def sweep_shm(since: float, shm_dir: str = SHM_DIR, owned: Iterable[str] = ()) -> list[str]:
    """Remove our uid's shared-memory segments (SHM_PREFIXES) created since ``since`` (epoch s) that no
    live process uses any more: what the run's engines left; and, whenever created, those named
    ``<ident>-...`` for an ``owned`` ident (the run's vLLM rendezvous names, :func:`vllm_dist_idents`).
    Returns the names removed."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    owned_prefixes = tuple(f"{ident}-" for ident in owned)
    candidates = []
    for name in names:
        mine = bool(owned_prefixes) and name.startswith(owned_prefixes)
        if not mine and not name.startswith(SHM_PREFIXES):
            continue
        try:
            st = os.stat(os.path.join(shm_dir, name))
        except OSError:
            continue
        if st.st_uid == os.getuid() and (mine or st.st_ctime >= since - 1.0):
            candidates.append(name)
    if not candidates:
        return []
    used = _shm_in_use() if shm_dir == SHM_DIR else set()
    removed = []
    for name in candidates:
        if name in used:
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def run_device_name(run_id: str) -> str:
    """The modelled device a run's simulated engines share when its scenario names none."""
    return f"kvdiag-{run_id}"


def remove_run_device(run_id: str, bound_s: float) -> bool:
    """Remove the run's own modelled-device files (/dev/shm/kvdiag-dev-<device>.acct and
    kvdiag-vmm-<device>.lock) once no live process uses them; True when none are left.

    Killed engines never unlink them (EngineCore exits by os._exit or SIGKILL), and until their
    new parent reaps them they still count as users: retry for up to ``bound_s``.
    """
    try:
        native = importlib.import_module("kvdiag._native")
    except ImportError:
        return True  # no native allocator: no engine of this run made device files
    name = run_device_name(run_id)
    paths = [native.device_account_path(name), native.device_lock_path(name)]
    deadline = time.monotonic() + bound_s
    while True:
        try:
            native.remove_stale_device_files(name)
        except Exception:  # noqa: BLE001 - a stranger's file we cannot open: leave it
            return False
        if not any(os.path.exists(p) for p in paths):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def removable_temp_dir(path: str) -> bool:
    """Only kvdiag's own folders directly in the temp dir (or in /tmp: the short socket folder of a run
    whose temp dir is too deep for Unix socket paths) are ever removed."""
    p = os.path.realpath(path)
    return (os.path.dirname(p) in (os.path.realpath(tempfile.gettempdir()), os.path.realpath("/tmp"))
            and os.path.basename(p).startswith("kvdiag-") and os.path.isdir(p))


def main(argv: list[str]) -> int:
    run_id = argv[0] if argv else None
    grace_s = float(argv[1]) if len(argv) > 1 else 3.0
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    # kvdiag's pid comes on the command line: by the time a slow reaper starts, a killed kvdiag may
    # already be gone and getppid() would name our new parent (init) instead.
    parent = int(argv[2]) if len(argv) > 2 else os.getppid()
    groups: set[int] = set()
    dirs: set[str] = set()
    shm_since: float | None = None
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            break
        text = line.decode(errors="replace").strip()
        if text == "exit":
            return 0  # clean shutdown: kvdiag already tore everything down
        if text.startswith("dir "):
            dirs.add(text[4:])
            continue
        if text.startswith("shm "):
            try:
                shm_since = float(text[4:])
            except ValueError:
                pass
            continue
        if len(text) > 1 and text[1:].isdigit():
            if text[0] == "+":
                groups.add(int(text[1:]))
            elif text[0] == "-":
                groups.discard(int(text[1:]))
    kill_groups(groups, run_id, grace_s)
    # A live kvdiag that abandoned us still copies its logs and removes the folders itself. A dying
    # one closes its files (our EOF) before it turns zombie or we are reparented: give it a moment.
    deadline = time.monotonic() + 2.0
    while alive(parent) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not alive(parent):
        idents = vllm_dist_idents(d for d in dirs if removable_temp_dir(d))
        for d in dirs:
            if removable_temp_dir(d):
                shutil.rmtree(d, ignore_errors=True)
        if shm_since is not None:
            sweep_shm(shm_since, owned=idents)
    # An engine forked just before kvdiag died carries the run marker only once it has exec'd, and
    # its group was never registered: one more sweep, after that exec, catches it.
    time.sleep(0.3)
    if run_id:
        kill_groups([], run_id, grace_s)
        remove_run_device(run_id, bound_s=10.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
