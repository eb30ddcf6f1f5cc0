"""On a busy machine an engine that has not printed its first line yet is starting, not stalled.

Under CPU spinners (more than there are cores, each bounded and killed afterwards), an engine whose
interpreter has not printed anything for longer than the stall window (its start delayed by a
silent `sleep`, as a starved interpreter is on a loaded host: no output, no CPU) must not be
declared stalled: the startup policy applies the window from the first log line, and the startup
timeout bounds the silence. Before the fix this run ended "stall detected", exit 10.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kvcli import read_report, run_kvdiag

from kvdiag.ports import free_port
from kvdiag.pymodule import module_argv

pytestmark = pytest.mark.timeout(300)

_SPIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"
_SILENT_S = 6     # the engine prints nothing and uses no CPU this long: 3 stall windows
_WINDOW_S = 2


@contextmanager
def spinners(n: int) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN], start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


def _scenario(tmp_path: Path) -> Path:
    port = free_port()
    engine = [*module_argv("kvdiag.sim"), "serve", "--port", str(port), "--allocator", "fixed"]
    shell = f"sleep {_SILENT_S}; exec " + " ".join(f"'{a}'" for a in engine)
    path = tmp_path / "slow-start.yaml"
    path.write_text(f"""name: slow-start
windows: {{stall_s: {_WINDOW_S}, startup_timeout_s: 120, timeout_s: 200, kill_grace_s: 2}}
engines:
  - name: slow
    kind: command
    port: {port}
    command: ["sh", "-c", "{shell}"]
""")
    return path


def test_silent_start_under_cpu_load_is_not_a_stall(tmp_path: Path) -> None:
    scen = _scenario(tmp_path)
    out = tmp_path / "out"
    with spinners((os.cpu_count() or 2) + 2):
        run = run_kvdiag("repro", "two-engine", "--scenario", str(scen), "--out", str(out), timeout=250)
    report = read_report(out)
    names = [e["event"] for e in report["timeline"]]  # type: ignore[union-attr]
    assert "stall detected" not in names, (names, run.stderr[-2000:])
    assert "ready" in names and run.returncode == 0, (names, run.stderr[-2000:])
    assert report["verdict"]["kind"] == "healthy"  # type: ignore[index]
