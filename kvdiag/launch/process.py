"""Engine processes: each in its own process group, logged to a file, always torn down."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType

from kvdiag import interrupts
from kvdiag.errors import EngineFailed
from kvdiag.launch.owned import RUN_ID_ENV, OwnedFiles, process_trees, run_processes, sweep_shm, vllm_dist_idents
from kvdiag.launch.reaper import group_is_ours, kill_groups, leader_start
from kvdiag.osread.holders import FileId
from kvdiag.pymodule import module_argv

# Where a launched engine's temp files go (sub-folders of the run's private folder): vLLM leaves ~7
# ZMQ socket files in VLLM_RPC_BASE_PATH, vllm_dist_* and torch caches in TMPDIR, and its cache root.
ENGINE_TEMP_DIRS = {"TMPDIR": "tmp", "VLLM_RPC_BASE_PATH": "rpc", "VLLM_CACHE_ROOT": "cache"}
_UNIX_PATH_MAX = 107   # sizeof(sockaddr_un.sun_path) - 1
# How often the run's processes are looked at for the /dev/shm files they hold (what kvdiag may remove
# at teardown): often enough to see a segment of an engine that crashes soon after making it, rarely
# enough to cost nothing (a few /proc reads of kvdiag's own processes).
OWNED_SAMPLE_S = 1.0


def private_temp_path(prefix: str) -> Path:
    """A fresh, not yet created folder name in the temp dir, for :meth:`ProcessSet.make_private_dir`."""
    return Path(tempfile.gettempdir()) / f"{prefix}{uuid.uuid4().hex[:12]}"


class Reaper:
    """Handle on the out-of-process reaper (kvdiag.launch.reaper)."""

    def __init__(self, run_id: str, grace_s: float = 3.0) -> None:
        self.run_id = run_id
        self._proc = subprocess.Popen(
            [*module_argv("kvdiag.launch.reaper"), run_id, str(grace_s), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True,
        )
        self._lock = threading.Lock()   # the run's sampler thread writes here too: whole lines only

    def _send(self, line: str) -> None:
        if self._proc.stdin is None:
            return
        with self._lock:
            try:
                self._proc.stdin.write(f"{line}\n".encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass

    def register(self, pgid: int, start: int | None = None) -> None:
        self._send(f"+{pgid}" if start is None else f"+{pgid} {start}")

    def unregister(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def sweep_shm_since(self, epoch_s: float) -> None:
        """Shared-memory segments engines create from ``epoch_s`` on are swept if kvdiag dies."""
        self._send(f"shm {epoch_s:.3f}")

    def remove_on_abandon(self, path: Path) -> None:
        """A private temp folder the reaper deletes if kvdiag dies without cleaning up."""
        self._send(f"dir {path}")

    def keep_on_abandon(self, path: Path) -> None:
        """Take back :meth:`remove_on_abandon` (the folder turned out not to be ours to create)."""
        self._send(f"undir {path}")

    def owns(self, ids: Iterable[FileId]) -> None:
        """/dev/shm files the run's processes were seen holding: the reaper may remove them once unused."""
        for dev, ino in ids:
            self._send(f"own {dev} {ino}")

    def abandon(self) -> None:
        """Close the pipe without "exit": the reaper then tears down every registered group."""
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass

    def close(self) -> None:
        """Tell the reaper everything is already cleaned up and wait for it."""
        self._send("exit")
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)


class EngineProcess:
    """One launched engine (its process group leader and everything under it)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path,
                 cwd: str | None = None) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.leader_start: int | None = None   # the leader's start time: its group is ours while it matches

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def start(self, reaper: Reaper | None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - handed to the child
        try:
            self.popen = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            )
        except FileNotFoundError:
            raise EngineFailed(f"engine {self.name!r}: command not found: {self.argv[0]}",
                               hint="check the scenario's command (is it installed and on PATH?)") from None
        except PermissionError:
            raise EngineFailed(f"engine {self.name!r}: cannot execute {self.argv[0]}") from None
        finally:
            log.close()
        self.started_at = time.monotonic()
        self.leader_start = leader_start(self.popen.pid)
        if reaper is not None:
            reaper.register(self.popen.pid, self.leader_start)

    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 5.0, reaper: Reaper | None = None) -> None:
        """SIGTERM the whole group, SIGKILL after grace_s; reap the leader."""
        if self.popen is None:
            return
        pgid = self.popen.pid
        kill_groups({pgid: self.leader_start}, self.env.get(RUN_ID_ENV), grace_s)
        try:
            self.popen.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=2)
        if reaper is not None:
            reaper.unregister(pgid)


class ProcessSet:
    """All engines of one run, with signal handling that guarantees teardown.

    Use as a context manager: SIGTERM and SIGHUP become :class:`Terminated`
    (Ctrl-C arrives as KeyboardInterrupt), and on exit every engine group is
    stopped. If kvdiag is SIGKILLed, the reaper does it instead.
    """

    def __init__(self, grace_s: float = 5.0) -> None:
        self.run_id = uuid.uuid4().hex[:12]
        self.grace_s = grace_s
        self.engines: list[EngineProcess] = []
        self.reaper: Reaper | None = None
        self._signals = ExitStack()
        self._teardown_hooks: list[Callable[[], None]] = []
        self._run_dir: Path | None = None
        self._short_rpc_dir: Path | None = None
        self._started_epoch = time.time()
        # The /dev/shm files the run's processes were seen holding: the only ones teardown may remove.
        self.owned = OwnedFiles()
        self.shm_left: list[str] = []    # what looked like the run's leftovers but was not provably its own
        self._sampler: threading.Thread | None = None
        self._sampler_stop = threading.Event()

    def on_teardown(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once the engines are stopped, while the reaper still guards the run (a kill
        landing then still gets the registered temp folders removed)."""
        self._teardown_hooks.append(hook)

    def __enter__(self) -> ProcessSet:
        self._started_epoch = time.time()
        self.reaper = Reaper(self.run_id)
        self.reaper.sweep_shm_since(self._started_epoch)
        self._signals.enter_context(interrupts.raising())
        return self

    def run_dir(self) -> Path:
        """This run's private temp folder (created on first use, removed at teardown, by the reaper if
        kvdiag is killed): engines' TMPDIR, vLLM's ZMQ sockets and cache, kvdiag's staged vLLM plugin."""
        if self._run_dir is None:
            path = private_temp_path("kvdiag-run-")
            self.make_private_dir(path)
            for sub in ENGINE_TEMP_DIRS.values():
                (path / sub).mkdir()
            self._run_dir = path
        return self._run_dir

    def _rpc_dir(self) -> Path:
        """VLLM_RPC_BASE_PATH: in the run folder, unless that makes a ZMQ socket path (the folder plus a
        36-character uuid) longer than a Unix socket address allows; then a short folder in /tmp."""
        rpc = self.run_dir() / ENGINE_TEMP_DIRS["VLLM_RPC_BASE_PATH"]
        if len(str(rpc)) + 1 + 36 <= _UNIX_PATH_MAX:
            return rpc
        if self._short_rpc_dir is None:
            short = Path("/tmp") / f"kvdiag-rpc-{uuid.uuid4().hex[:12]}"
            self.make_private_dir(short)
            self._short_rpc_dir = short
        return self._short_rpc_dir

    def env_for(self, extra: dict[str, str]) -> dict[str, str]:
        """An engine's environment: ours, the scenario's additions, the run marker, and its temp files
        (TMPDIR, VLLM_RPC_BASE_PATH, VLLM_CACHE_ROOT) in the run's private folder unless the scenario
        sets them."""
        env = dict(os.environ)
        run_dir = self.run_dir()
        for key, sub in ENGINE_TEMP_DIRS.items():
            env[key] = str(run_dir / sub)
        env["VLLM_RPC_BASE_PATH"] = str(self._rpc_dir())
        env.update(extra)
        env[RUN_ID_ENV] = self.run_id
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def make_private_dir(self, path: Path) -> None:
        """Create ``path`` (mode 0700) after telling the reaper to delete it if kvdiag dies first:
        no kill can land between the two and leave it behind. A folder already there is not ours: the
        reaper is told to leave it."""
        if self.reaper is not None:
            self.reaper.remove_on_abandon(path)
        try:
            path.mkdir(mode=0o700)
        except OSError:
            if self.reaper is not None:
                self.reaper.keep_on_abandon(path)
            raise

    def start(self, engine: EngineProcess) -> None:
        self.engines.append(engine)
        engine.start(self.reaper)
        if self._sampler is None:
            self._sampler = threading.Thread(target=self._sample, name="kvdiag-owned-files", daemon=True)
            self._sampler.start()

    def _groups(self) -> dict[int, int | None]:
        return {e.pid: e.leader_start for e in list(self.engines) if e.pid is not None}

    def observe(self, marked: bool = False) -> None:
        """Record the /dev/shm files the run's processes hold now (the engines' trees; ``marked``: every
        member of their groups and every process with the run's marker, a look over the whole host for
        teardown) and tell the reaper."""
        groups = [g for g, start in self._groups().items() if group_is_ours(g, start, self.run_id)]
        new = self.owned.observe(run_processes(groups, self.run_id) if marked else process_trees(groups))
        if new and self.reaper is not None:
            self.reaper.owns(sorted(new))

    def _sample(self) -> None:
        while not self._sampler_stop.wait(OWNED_SAMPLE_S):
            try:
                self.observe()
            except Exception:  # noqa: BLE001 - a failed look costs only what it would have seen
                continue

    def _stop_sampling(self) -> None:
        self._sampler_stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5)

    def stop_all(self) -> None:
        """Stop every engine group at once (one grace period in all, not one per engine)."""
        groups = self._groups()
        kill_groups(groups, self.run_id, self.grace_s)
        for engine in self.engines:
            if engine.popen is not None:
                try:
                    engine.popen.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    engine.popen.kill()
                if self.reaper is not None and engine.pid is not None:
                    self.reaper.unregister(engine.pid)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        held = interrupts.held()   # teardown must not be cut short by a second Ctrl-C or SIGTERM
        held.__enter__()
        clean = False
        try:
            self._stop_sampling()
            if self.engines:
                self.observe(marked=True)   # what they hold as they are stopped is theirs too
            self.stop_all()
            idents = vllm_dist_idents([self._run_dir] if self._run_dir is not None else [])
            for folder in (self._run_dir, self._short_rpc_dir):
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
            if self.engines:
                # vLLM's psm_* queues of engines that were killed, its TP all-reduce segments always:
                # only those the run's processes were seen holding, and only once nobody holds them.
                swept = sweep_shm(self._started_epoch, self.owned.seen, idents=idents)
                self.shm_left = swept.left
                if swept.left:
                    print(f"kvdiag: left in /dev/shm: {', '.join(swept.left)} (made during the run and unused, "
                          "but no process kvdiag started was seen holding them: not removed)", file=sys.stderr)
            clean = True
            for hook in self._teardown_hooks:
                try:
                    hook()
                except Exception as exc:  # a failed log copy must not mask why the run ended
                    print(f"kvdiag: warning: teardown step failed: {exc}", file=sys.stderr)
        finally:
            if self.reaper is not None:
                if clean:
                    self.reaper.close()
                else:
                    self.reaper.abandon()  # EOF: the reaper kills whatever is left
            held.__exit__(None, None, None)
            self._signals.close()
