"""Verdict accuracy on deterministic hanging programs, with all tools and with pystack missing.

Every hanger in tests/fixtures/hangers (GIL cycle in three shapes, one of them on a stripped
interpreter, lock-order inversion, lost wakeup, blocked IPC read) and two healthy programs
(busy, idle server) is started --runs times; each run is captured (all backends, read-only)
and analyzed. The same is repeated with pystack unavailable. The expected verdict of each
program comes from how it was written (hanger_kit.KINDS), not from the analyzer.

    python benchmarks/accuracy.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "hangers"))

import hanger_kit as hk  # noqa: E402

from kvdiag.analyze import analyze  # noqa: E402
from kvdiag.capture import capture_processes, process_tree  # noqa: E402
from kvdiag.capture.base import CaptureBackend  # noqa: E402
from kvdiag.capture.tools import PystackBackend  # noqa: E402
from kvdiag.model import Bundle, VerdictKind  # noqa: E402


def capture_verdict(root: int, raw: Path, backends: Sequence[str | CaptureBackend]) -> str:
    evidence, findings = capture_processes(process_tree(root), raw, timeout_s=10.0, backends=backends)
    return analyze(Bundle(processes=evidence, findings=findings)).kind.value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-bench-accuracy-"))
    stripped = hk.stripped_libpython(tmp / "stripped")
    cases: list[tuple[str, str, dict[str, str] | None]] = [(k, k, None) for k in hk.KINDS if k != "dstate"]
    if stripped is not None:
        cases.insert(2, ("gil_cycle_stripped", "gil_cycle_native", dict(os.environ, LD_LIBRARY_PATH=str(stripped))))
    modes: dict[str, list[str | CaptureBackend]] = {
        "all_tools": ["proc", "py-spy", "pystack", "gdb"],
        "pystack_missing": ["proc", "py-spy", PystackBackend(binary=str(tmp / "no-pystack")), "gdb"],
    }
    tally: dict[str, dict[str, Counter[str]]] = {m: {} for m in modes}
    start = time.monotonic()
    for name, kind, env in cases:
        for mode, backends in modes.items():
            seen: Counter[str] = Counter()
            for i in range(args.runs):
                with hk.running(kind, env=env, bound_s=90, build_dir=tmp / "build") as h:
                    seen[capture_verdict(h.root_pid, tmp / f"{name}-{mode}-{i}", backends)] += 1
            tally[mode][name] = seen
    print(f"{'program':22} {'expected':22} {'all tools':28} {'pystack missing':28}")
    results: dict[str, dict[str, float]] = {}
    for mode in modes:
        total = correct = healthy = false_dl = hangs = missed = 0
        for name, kind, _ in cases:
            expect = hk.KINDS[kind].expect
            for verdict, n in tally[mode][name].items():
                total += n
                correct += n * (verdict == expect)
                is_hang = VerdictKind(verdict).is_hang
                if hk.KINDS[kind].hangs:
                    hangs += n
                    missed += n * (not is_hang)
                else:
                    healthy += n
                    false_dl += n * is_hang
        results[mode] = {"accuracy": correct / total, "false_deadlock": false_dl / max(healthy, 1),
                         "missed_deadlock": missed / max(hangs, 1)}
    for name, kind, _ in cases:
        cells = [", ".join(f"{v} x{n}" for v, n in sorted(tally[m][name].items())) for m in modes]
        print(f"{name:22} {hk.KINDS[kind].expect:22} {cells[0]:28} {cells[1]:28}")
    for mode, r in results.items():
        print(f"{mode:16} accuracy {r['accuracy']:.3f}  false deadlock {r['false_deadlock']:.3f}  "
              f"missed deadlock {r['missed_deadlock']:.3f}")
    print(f"{len(cases)} programs x {args.runs} runs x {len(modes)} modes in {time.monotonic() - start:.0f}s")
    a = results["all_tools"]
    print(f"RESULT accuracy={a['accuracy']:.3f} false_deadlock={a['false_deadlock']:.3f} "
          f"missed_deadlock={a['missed_deadlock']:.3f} "
          f"accuracy_tool_missing={results['pystack_missing']['accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
