"""Start and stop simulated engines from Python (tests, benchmarks, quick experiments).

Each engine runs in its own process group with its log in a file; every wait is bounded and
:meth:`SimProcess.stop` escalates SIGTERM -> SIGKILL on the whole group, so nothing survives.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

import httpx

from kvdiag.osread.children import children
from kvdiag.osread.process import read_comm
from kvdiag.ports import free_port
from kvdiag.sim.cmdline import command

__all__ = ["SimProcess"]


class SimProcess:
    """One ``python -m kvdiag.sim serve`` process tree."""

    def __init__(self, log_path: Path, port: int | None = None, argv: list[str] | None = None,
                 env: dict[str, str] | None = None, host: str = "127.0.0.1", **params: object) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.argv = argv if argv is not None else command(self.port, host=host, **params)  # type: ignore[arg-type]
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.update(env or {})
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None, "not started"
        return self.popen.pid

    def start(self) -> SimProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab", buffering=0) as log:
            self.popen = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        return self

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def wait_log(self, pattern: str, timeout_s: float) -> re.Match[str] | None:
        """First match of ``pattern`` in the log, waiting up to ``timeout_s``."""
        rx = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout_s
        while True:
            m = rx.search(self.log_text())
            if m is not None or time.monotonic() >= deadline:
                return m
            time.sleep(0.05)

    def healthy(self, timeout_s: float = 1.0) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout_s, trust_env=False).status_code == 200
        except (httpx.HTTPError, OSError):
            return False

    def wait_healthy(self, timeout_s: float = 30.0) -> bool:
        """True once /health answers 200; False on timeout or if the server exited."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy(0.5):
                return True
            if self.returncode() is not None:
                return False
            time.sleep(0.05)
        return False

    def engine_core_pid(self, timeout_s: float = 10.0) -> int | None:
        """The EngineCore child (its comm is ``VLLM::EngineCor``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for child in children(self.pid) or []:
                if read_comm(child) == "VLLM::EngineCor":
                    return child
            if time.monotonic() >= deadline or self.returncode() is not None:
                return None
            time.sleep(0.05)

    def wait_exit(self, timeout_s: float) -> int | None:
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def _group_gone(self, pgid: int, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while True:
            if self.popen is not None:
                self.popen.poll()  # reap the leader, or its zombie keeps the group alive
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; reap the leader."""
        if self.popen is None:
            return
        pgid = self.popen.pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            if self._group_gone(pgid, wait_s):
                break
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> SimProcess:
        if self.popen is None:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
