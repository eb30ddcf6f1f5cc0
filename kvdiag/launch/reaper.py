"""Out-of-process reaper: kills everything kvdiag started once kvdiag is gone.

kvdiag starts it in its own session and keeps a pipe to its stdin. kvdiag writes
``+PGID START`` / ``-PGID`` lines as it starts and reaps engines (START: the
leader's start time, so a group number reused by another program is never
signalled), and ``own DEV INO`` for every /dev/shm file its engines were seen
holding. When the pipe reaches EOF — kvdiag exited, crashed or was SIGKILLed —
the reaper looks once more at what the run's processes hold, SIGTERMs every
registered process group, SIGKILLs what is left after a grace period, and
sweeps any process whose environment carries ``KVDIAG_RUN_ID=<run id>`` (a
child that left its process group), then removes the private temp folders
registered with ``dir PATH`` (raw, unredacted engine logs must not outlive a
killed kvdiag), the /dev/shm files the run's processes held that nobody holds
any more (:mod:`kvdiag.launch.owned`) and the run's own modelled-device files.
It ignores SIGINT/SIGTERM/SIGHUP so a Ctrl-C or a terminal hang-up cannot stop
it before it has cleaned up.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping

from kvdiag.launch.owned import RUN_ID_ENV, OwnedFiles, run_processes, sweep_shm, vllm_dist_idents
from kvdiag.osread.process import read_environ
from kvdiag.osread.ptable import alive, group_alive
from kvdiag.osread.stat import all_pids, all_stats, read_stat

__all__ = ["group_is_ours", "kill_groups", "leader_start", "pids_with_marker"]


def pids_with_marker(run_id: str) -> list[int]:
    """Pids whose environment holds KVDIAG_RUN_ID=run_id (zombies excluded)."""
    me = os.getpid()
    return [pid for pid in all_pids()
            if pid != me and (read_environ(pid) or {}).get(RUN_ID_ENV) == run_id and alive(pid)]


def leader_start(pid: int) -> int | None:
    """The start time (clock ticks after boot) of process ``pid``: with the pid, which process it is."""
    st = read_stat(pid)
    return st.starttime if st is not None else None


def group_is_ours(pgid: int, start: int | None, run_id: str | None) -> bool:
    """Whether process group ``pgid`` is still the one kvdiag started: its leader is the process that
    started at ``start`` (a zombie leader still is), or, the leader gone, a live member carries the run's
    marker. A group whose number came back to another program (the pid reused after ours ended) is not."""
    st = read_stat(pgid)
    if st is not None and start is not None:
        return st.starttime == start
    if st is not None and st.state not in ("Z", "X") and (read_environ(pgid) or {}).get(RUN_ID_ENV) == run_id:
        return run_id is not None
    return run_id is not None and any(
        m.pgid == pgid and m.state not in ("Z", "X") and (read_environ(m.pid) or {}).get(RUN_ID_ENV) == run_id
        for m in all_stats())


def _signal_groups(groups: Mapping[int, int | None], run_id: str | None, sig: signal.Signals) -> None:
    for pgid, start in groups.items():
        if group_is_ours(pgid, start, run_id):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def kill_groups(groups: Mapping[int, int | None], run_id: str | None, grace_s: float) -> None:
    """SIGTERM the groups kvdiag started (pgid -> its leader's start time, :func:`group_is_ours`) and the
    run's marked stragglers, wait up to grace_s, then SIGKILL what is left."""
    groups = {g: s for g, s in groups.items() if g > 1 and g != os.getpgrp() and group_is_ours(g, s, run_id)}
    _signal_groups(groups, run_id, signal.SIGTERM)
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
    _signal_groups(groups, run_id, signal.SIGKILL)
    if run_id:
        for pid in pids_with_marker(run_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


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
    groups: dict[int, int | None] = {}
    dirs: set[str] = set()
    shm_since: float | None = None
    owned = OwnedFiles()
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
        if text.startswith("undir "):
            dirs.discard(text[6:])
            continue
        if text.startswith("shm "):
            try:
                shm_since = float(text[4:])
            except ValueError:
                pass
            continue
        if text.startswith("own "):
            parts = text.split()
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                owned.add([(int(parts[1]), int(parts[2]))])
            continue
        word, _, start = text.partition(" ")
        if len(word) > 1 and word[1:].isdigit():
            if word[0] == "+":
                groups[int(word[1:])] = int(start) if start.isdigit() else None
            elif word[0] == "-":
                groups.pop(int(word[1:]), None)
    # What the run's processes hold as they are killed is theirs too (files made since kvdiag's last look).
    owned.observe(run_processes([g for g, start in groups.items() if group_is_ours(g, start, run_id)], run_id))
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
            sweep_shm(shm_since, owned.seen, idents=idents)
    # An engine forked just before kvdiag died carries the run marker only once it has exec'd, and
    # its group was never registered: one more sweep, after that exec, catches it.
    time.sleep(0.3)
    if run_id:
        kill_groups({}, run_id, grace_s)
        remove_run_device(run_id, bound_s=10.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
