"""`kvdiag watch` as a user runs it (a subprocess in its own session), its JSON-line events read as they come."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class WatchProc:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.events: list[dict[str, Any]] = []
        self.stderr_lines: list[str] = []
        self._q: queue.Queue[dict[str, Any]] = queue.Queue()
        self.popen: subprocess.Popen[str] | None = None

    def start(self) -> WatchProc:
        self.popen = subprocess.Popen([sys.executable, "-m", "kvdiag", "watch", *self.args], cwd=ROOT, env=self.env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        return self

    def _read_stdout(self) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        for line in self.popen.stdout:
            ev = json.loads(line)      # every stdout line is one JSON event
            self.events.append(ev)
            self._q.put(ev)

    def _read_stderr(self) -> None:
        assert self.popen is not None and self.popen.stderr is not None
        for line in self.popen.stderr:
            self.stderr_lines.append(line.rstrip("\n"))

    def wait_event(self, name: str, timeout_s: float) -> dict[str, Any] | None:
        """The next event named ``name`` (others seen meanwhile stay in :attr:`events`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                ev = self._q.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.popen is not None and self.popen.poll() is not None and self._q.empty():
                    time.sleep(0.2)
                    if self._q.empty():
                        return None
                continue
            if ev["event"] == name:
                return ev

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    def wait(self, timeout_s: float) -> int | None:
        assert self.popen is not None
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)

    def diag(self) -> str:
        return "\n".join(json.dumps(e) for e in self.events) + "\n" + "\n".join(self.stderr_lines[-40:])
