"""`kvdiag capture` touches one engine only: pid 1, shells and other users' trees are refused without
--all-descendants, and --engine-core-of picks the EngineCore under the API server the user names.

Real processes throughout: a parent with children titled VLLM::EngineCore, a child running as
another user, the GIL-cycle hanger under a parent (the API server / EngineCore shape).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from procs import kill_group

from kvdiag.capture.select import capture_scope, engine_cores_of
from kvdiag.cli.main import main as kvdiag_main
from kvdiag.osread.ptable import process_tree

HANGERS = Path(__file__).resolve().parents[1] / "fixtures" / "hangers"
sys.path.insert(0, str(HANGERS))
import hanger_kit as hk  # noqa: E402

pytestmark = pytest.mark.timeout(150)


def cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = kvdiag_main(list(argv))
    return code, out.getvalue()


@contextmanager
def tree(script: str, children: int) -> Iterator[int]:
    """A parent process (own session) running ``script``; yields once it has ``children`` children."""
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(process_tree(proc.pid)) < 1 + children:
            assert proc.poll() is None, "the parent exited early"
            assert time.monotonic() < deadline, "children never appeared"
            time.sleep(0.05)
        yield proc.pid
    finally:
        kill_group(proc, 30)


ENGINE_CORES = ("import subprocess, time\n"
                "kids = [subprocess.Popen(['VLLM::EngineCore', '120'], executable='sleep') for _ in range({n})]\n"
                "time.sleep(120)\n")
FOREIGN_CHILD = ("import subprocess, time\n"
                 "kid = subprocess.Popen(['sleep', '120'], user=65534)\n"
                 "time.sleep(120)\n")


def test_pid_1_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    code, out = cli("capture", "--pid", "1", "--out", str(tmp_path / "run"))
    assert code == 2, out
    assert "refusing to capture pid 1" in out and "init process" in out
    assert "--engine-core-of" in out and "--all-descendants" in out
    assert not (tmp_path / "run").exists()


def test_an_ancestor_of_kvdiag_is_refused(tmp_path: Path) -> None:
    parent = os.getppid()
    if parent <= 1:
        pytest.skip("pytest runs directly under init: no ancestor to name but pid 1")
    code, out = cli("capture", "--pid", str(parent), "--out", str(tmp_path / "run"))
    assert code == 2, out
    assert "ancestor of kvdiag" in out and not (tmp_path / "run").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_a_tree_with_another_users_process_needs_consent(tmp_path: Path) -> None:
    with tree(FOREIGN_CHILD, 1) as parent:
        scope = capture_scope(parent)
        assert scope.pids == process_tree(parent) and len(scope.pids) == 2
        code, out = cli("capture", "--pid", str(parent), "--out", str(tmp_path / "refused"))
        assert code == 2, out
        assert "other users" in out and "uid 65534: 1 process" in out
        assert not (tmp_path / "refused").exists()
        code, out = cli("capture", "--pid", str(parent), "--all-descendants", "--tools", "proc",
                        "--out", str(tmp_path / "run"))
        assert code == 0, out
        data = json.loads((tmp_path / "run" / "bundle" / "bundle.json").read_text())
        assert {p["pid"] for p in data["processes"]} == set(scope.pids)


def test_engine_core_of_without_or_with_several_engine_cores_is_a_usage_error(tmp_path: Path) -> None:
    with tree(ENGINE_CORES.format(n=0), 0) as parent:
        code, out = cli("capture", "--engine-core-of", str(parent), "--out", str(tmp_path / "none"))
        assert code == 2 and "no VLLM::EngineCore process under it" in out, out
    with tree(ENGINE_CORES.format(n=2), 2) as parent:
        cores = engine_cores_of(parent)
        assert len(cores) == 2 and parent not in cores
        code, out = cli("capture", "--engine-core-of", str(parent), "--out", str(tmp_path / "two"))
        assert code == 2 and "2 EngineCore processes" in out and all(str(c) in out for c in cores), out
    assert not (tmp_path / "none").exists() and not (tmp_path / "two").exists()
    code, out = cli("capture", "--pid", "1", "--engine-core-of", "1")
    assert code == 2 and "exactly one of" in out


def test_engine_core_of_captures_the_engine_core_not_the_api_server(tmp_path: Path) -> None:
    with hk.running("gil_cycle", under_parent=True, title="VLLM::EngineCore", bound_s=100,
                    build_dir=tmp_path / "build") as h:
        assert engine_cores_of(h.root_pid) == [h.pid]
        code, out = cli("capture", "--engine-core-of", str(h.root_pid), "--out", str(tmp_path / "run"))
    assert code == 10, out
    assert f"capturing pid {h.pid}" in out and "verdict: gil_cycle" in out
    data = json.loads((tmp_path / "run" / "bundle" / "bundle.json").read_text())
    assert [p["pid"] for p in data["processes"]] == [h.pid]
    assert data["processes"][0]["role"] == "engine_core"
    assert data["command"] == f"capture --engine-core-of {h.root_pid}"      # as the user typed it
