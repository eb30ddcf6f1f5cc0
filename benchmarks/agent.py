"""Capture without ptrace: the agent path against the ptrace path, on the corpus and on a real vLLM (TP=1, TP=2).

Corpus: programs of tests/fixtures/hangers (single-process ones) are started with KVDIAG_AGENT=1 and each
captured twice, the same way (all tools, the whole tree, analyzed): once as is (the ptrace tools read it) and
once from a process under a seccomp filter that refuses ptrace(2) and process_vm_readv(2)
(tests/fixtures/no_ptrace.py, as in a container without SYS_PTRACE), where kvdiag reads it through its agent.
Which goes first alternates. A case agrees when both give the same verdict kind; for a GIL cycle the holder
and waiter threads must match too. By default a chosen third of the corpus (every GIL-cycle program, every
GIL-held one, and one or two of each other verdict; PICK), three programs at a time; ``--corpus all`` runs
every program (about 4 minutes more).

vLLM (real, CPU; skipped when the vLLM CPU venv is missing), started before the corpus so that it boots
meanwhile: the shipped tp2-vllm-cpu scenario (rank 1 hangs in its worker) run by a kvdiag under the seccomp
filter with every engine armed; and two TP=1 `vllm serve` side by side, one armed (KVDIAG_AGENT=1), one not.
Once the corpus and the TP=2 run are done (nothing else of the benchmark running): paired rounds of the same
completion on each, the first server alternating per round (A B | B A | ...), tokens/s armed / not per
round with its 95 % interval and the same-server noise floor; the armed server's agent answers timed per
process; then the plugin's GIL cycle injected in the armed EngineCore, captured under the seccomp filter.

    python benchmarks/agent.py [--corpus pick|all] [--only NAME ...] [--skip-vllm] [--skip-corpus] [--no-tp2]
                               [--pairs 150] [--jobs 3] [--write FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "hangers"))
NO_PTRACE = ROOT / "tests" / "fixtures" / "no_ptrace.py"

import hanger_kit as hk  # noqa: E402

from kvdiag.agent.protocol import ENABLE_ENV  # noqa: E402


def capture_one(pid: int, out: Path) -> dict[str, object]:
    """The capture `kvdiag capture --pid` makes (whole tree, all tools), analyzed: what the table needs."""
    from kvdiag.analyze.overall import analyze
    from kvdiag.capture.bundle import capture_tree

    bundle = capture_tree(pid, out, timeout_s=10.0, save=False)
    v = analyze(bundle)
    paths = [f.message for f in bundle.findings if f.kind == "capture_path"]
    agent = [t.duration_s for p in bundle.processes for t in p.tools if t.tool == "agent" and t.ok]
    # the thread and its role; the bracketed signals name the tool that saw them, which differs by path
    return {"kind": v.kind.value, "evidence": sorted({(e.tid or 0, (e.role or "").split(" [")[0]) for e in v.evidence}),
            "via_agent": bool(paths), "agent_s": agent}


def run_capture(pid: int, seccomp: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="kvdiag-agent-bench-") as tmp:
        argv = [sys.executable, __file__, "--capture-one", str(pid), tmp]
        if seccomp:
            argv = [sys.executable, str(NO_PTRACE), *argv]
        env = {k: v for k, v in os.environ.items() if k != ENABLE_ENV}
        r = subprocess.run(argv, capture_output=True, text=True, timeout=90, env=env)
        if r.returncode != 0:
            return {"kind": f"error rc={r.returncode}: {r.stderr.strip().splitlines()[-1:]}", "evidence": [],
                    "via_agent": False, "agent_s": []}
        return json.loads(r.stdout.strip().splitlines()[-1])


# The default corpus: every GIL-cycle and GIL-held program (the agent's own GIL reading, and the sleeping holder
# it must not wake), the other verdict kinds once or twice (native and Python locks, lost wakeups, IPC reads,
# slow starts, decode stall, crash, OOM, stopped, traced, D state) and the healthy shapes that a dump must not
# disturb into a hang (timed waits, pools, asyncio, a thread that signals on a timer).
PICK = ["gil_cycle", "gil_cycle_native", "gil_cycle_stripped", "gil_cycle_ctypes", "gil_cycle_ctypes_callback",
        "gil_cycle_pybind11", "gil_cycle_pybind11_stripped", "gil_cycle_nanobind", "stopped_gil_cycle",
        "gil_held_queue", "gil_held_read_queue", "gil_held_sleep", "gil_held_condvar",
        "lock_inversion", "lock_inversion_py2", "lost_wakeup", "lost_wakeup_py", "self_deadlock",
        "ipc_read", "ipc_read_asyncio", "slow_start_cpu", "slow_start_timed", "decode_stall",
        "crash_segfault", "oom_host", "stopped", "traced", "dstate",
        "healthy_busy", "healthy_idle", "healthy_gil_timed", "healthy_timed_signaller", "healthy_pool",
        "healthy_asyncio", "family_gomp_fork", "family_healthy_native_compute"]


def _case(i: int, kind: str) -> tuple[dict[str, object], dict[str, object]]:
    env = dict(os.environ, **{ENABLE_ENV: "1"})
    with hk.running(kind, env=env, bound_s=300.0) as h:
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {seccomp: run_capture(h.root_pid, seccomp) for seccomp in order}
    return got[False], got[True]


def corpus(which: str, only: list[str], jobs: int) -> list[str]:
    names = only or (list(hk.KINDS) if which == "all" else PICK)
    kinds = [k for k in names if k in hk.KINDS and not hk.KINDS[k].xproc and hk.available(k) is None]
    rows, agree, cycles, cycles_named, agent_times = [], 0, 0, 0, []
    t0 = time.monotonic()
    print(f"{'program':32} {'expected':22} {'ptrace':22} {'agent':22} same  via", flush=True)
    # Programs are independent (own process, own captures); a few at once, the table in corpus order.
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="corpus") as pool:
        results = list(pool.map(_case, range(len(kinds)), kinds))
    for kind, (a, b) in zip(kinds, results, strict=True):
        spec = hk.KINDS[kind]
        same = a["kind"] == b["kind"]
        if a["kind"] == "gil_cycle" or spec.expect == "gil_cycle":
            cycles += 1
            named = b["kind"] == "gil_cycle" and a["evidence"] == b["evidence"]
            cycles_named += named
            same = same and named
        agree += same
        agent_times += list(b["agent_s"])  # type: ignore[arg-type]
        rows.append(f"{kind:32} {spec.expect:22} {a['kind']:22} {b['kind']:22} {'yes' if same else 'NO ':4}  "
                    f"{'agent' if b['via_agent'] else '-'}")
        print(rows[-1], flush=True)
    share = agree / len(kinds) if kinds else 0.0
    p50 = statistics.median(agent_times) if agent_times else 0.0
    summary = (f"corpus ({which if not only else 'only'}, {len(kinds)} programs, {jobs} at a time, "
               f"{time.monotonic() - t0:.0f}s): {agree}/{len(kinds)} verdicts identical ({share:.1%}); GIL cycles "
               f"named with holder and waiter through the agent: {cycles_named}/{cycles}; agent dump (request to "
               f"file read) p50 {p50 * 1000:.1f} ms, max {max(agent_times, default=0) * 1000:.1f} ms over "
               f"{len(agent_times)} dumps")
    print(summary, flush=True)
    return [*rows, summary, f"RESULT_CORPUS agreement={share:.3f} gil_cycles_named={cycles_named}/{cycles}"]


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--capture-one":
        print(json.dumps(capture_one(int(sys.argv[2]), Path(sys.argv[3]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", choices=("pick", "all"), default="pick")
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-corpus", action="store_true")
    ap.add_argument("--no-tp2", action="store_true", help="without the TP=2 repro")
    ap.add_argument("--pairs", type=int, default=150, help="paired rounds armed/not (at most --pairs-budget-s)")
    ap.add_argument("--pairs-budget-s", type=float, default=60.0)
    ap.add_argument("--jobs", type=int, default=3, help="corpus programs at a time")
    ap.add_argument("--write", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args()
    t0 = time.monotonic()
    lines: list[str] = []
    vllm = None
    if not args.skip_vllm:
        import agent_vllm  # the real-vLLM half (its own file: it needs tests/vllm)

        vllm = agent_vllm.start(tp1=True, tp2=not args.no_tp2)
    try:
        if not args.skip_corpus:
            lines += corpus(args.corpus, args.only, args.jobs)
        if vllm is not None:
            if vllm.skipped:
                lines.append(vllm.skipped)
            else:
                agent_vllm.tp2_result(vllm)      # first: the rounds below run with nothing else of ours running
                agent_vllm.rounds(vllm, args.pairs, args.pairs_budget_s)
                lines += vllm.lines
    finally:
        if vllm is not None:
            agent_vllm.stop(vllm)
    took = time.monotonic() - t0
    lines.append(f"benchmark wall time {took:.0f}s")
    print(lines[-1])
    result = " ".join(ln.split(" ", 1)[1] for ln in lines if ln.startswith("RESULT_"))
    print(f"RESULT {result} wall_s={took:.0f}")
    if args.write:
        args.write.write_text("\n".join(lines) + f"\nRESULT {result} wall_s={took:.0f}\n", encoding="utf-8")


if __name__ == "__main__":
    main()
