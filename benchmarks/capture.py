"""Capture speed: all backends on a 2-process tree, in parallel vs one after the other.

The tree is shaped like the simulated engine's: a parent (API server) and a child titled
VLLM::EngineCore that is stuck in the GIL cycle (tests/fixtures/hangers). Each round runs
kvdiag's parallel capture and the serial baseline on the same live tree, alternating which
goes first. Target: parallel <= 3 s.

    python benchmarks/capture.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "hangers"))

import hanger_kit as hk  # noqa: E402

from kvdiag.analyze import analyze  # noqa: E402
from kvdiag.capture import capture_processes, process_tree  # noqa: E402
from kvdiag.model import Bundle  # noqa: E402

TARGET_PARALLEL_S = 3.0


def one(pids: list[int], raw: Path, parallel: bool) -> tuple[float, float, str, bool]:
    start = time.monotonic()
    evidence, findings = capture_processes(pids, raw, timeout_s=10.0, parallel=parallel)
    wall = time.monotonic() - start
    tool_sum = sum(r.duration_s for e in evidence for r in e.tools)
    ok = all(r.ok for e in evidence for r in e.tools)
    return wall, tool_sum, analyze(Bundle(processes=evidence, findings=findings)).kind.value, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    par: list[float] = []
    ser: list[float] = []
    sums: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvdiag-bench-capture-") as tmp, \
            hk.running("gil_cycle", under_parent=True, title="VLLM::EngineCore", bound_s=240) as h:
        pids = process_tree(h.root_pid)
        print(f"tree: {pids} (parent {h.root_pid}, EngineCore {h.pid}); backends proc, py-spy, pystack, gdb")
        one(pids, Path(tmp) / "warmup", True)           # page cache, tool start-up
        print(f"{'round':>5} {'parallel_s':>11} {'serial_s':>9} {'tool_sum_s':>11} {'verdict':>10} all_ok")
        for i in range(args.rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            res = {mode: one(pids, Path(tmp) / f"r{i}-{mode}", mode) for mode in order}
            p, s = res[True], res[False]
            par.append(p[0])
            ser.append(s[0])
            sums.append(p[1])
            print(f"{i:>5} {p[0]:>11.3f} {s[0]:>9.3f} {p[1]:>11.3f} {p[2]:>10} {p[3] and s[3]}")
    p_med, s_med = statistics.median(par), statistics.median(ser)
    print(f"median: parallel {p_med:.3f}s, serial {s_med:.3f}s, speed-up {s_med / p_med:.2f}x; "
          f"target parallel <= {TARGET_PARALLEL_S}s: {'met' if p_med <= TARGET_PARALLEL_S else 'MISSED'}")
    print(f"RESULT parallel_s={p_med:.3f} serial_s={s_med:.3f} speedup={s_med / p_med:.2f} "
          f"tool_sum_s={statistics.median(sums):.3f} target_met={int(p_med <= TARGET_PARALLEL_S)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
