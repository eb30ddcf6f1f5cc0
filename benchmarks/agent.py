"""Capture without ptrace: the agent path against the ptrace path, on the corpus and on a real vLLM.

Corpus: every single-process program of tests/fixtures/hangers (hanger_kit.KINDS without the
cross-process table) is started once with KVDIAG_AGENT=1 and captured twice, the same way (all tools,
the whole tree, analyzed): once as is (the ptrace tools read it) and once from a process under a seccomp
filter that refuses ptrace(2) and process_vm_readv(2) (tests/fixtures/no_ptrace.py, as in a container
without SYS_PTRACE), where kvdiag reads it through its agent. Which goes first alternates. A case agrees
when both give the same verdict kind; for a GIL cycle the holder and waiter threads must match too.

vLLM (real, CPU, TP=1; skipped when the vLLM CPU venv is missing): two `vllm serve` side by side, one
armed (KVDIAG_AGENT=1), one not; paired rounds of the same completion on each, order alternating
(tokens/s armed / not); the armed server's agent answers timed per process; then the plugin's injected
GIL cycle in the armed EngineCore, captured under the seccomp filter: named through the agent alone.

TP=2 (``--tp2``): the shipped tp2-vllm-cpu scenario (rank 1 hangs in its worker) run by a kvdiag under the
seccomp filter with every engine process armed.

    python benchmarks/agent.py [--only NAME ...] [--skip-vllm] [--skip-corpus] [--rounds 8] [--tp2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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


def corpus(only: list[str]) -> list[str]:
    kinds = [k for k, s in hk.KINDS.items() if not s.xproc and hk.available(k) is None and (not only or k in only)]
    env = dict(os.environ, **{ENABLE_ENV: "1"})
    rows, agree, cycles, cycles_named, agent_times = [], 0, 0, 0, []
    print(f"{'program':32} {'expected':22} {'ptrace':22} {'agent':22} same  via")
    for i, kind in enumerate(kinds):
        spec = hk.KINDS[kind]
        with hk.running(kind, env=env, bound_s=300.0) as h:
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {seccomp: run_capture(h.root_pid, seccomp) for seccomp in order}
        a, b = got[False], got[True]
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
    summary = (f"corpus: {agree}/{len(kinds)} verdicts identical ({share:.1%}); GIL cycles named with holder and "
               f"waiter through the agent: {cycles_named}/{cycles}; agent dump (request to file read) p50 "
               f"{p50 * 1000:.1f} ms, max {max(agent_times, default=0) * 1000:.1f} ms over {len(agent_times)} dumps")
    print(summary)
    return [*rows, summary, f"RESULT_CORPUS agreement={share:.3f} gil_cycles_named={cycles_named}/{cycles}"]


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--capture-one":
        print(json.dumps(capture_one(int(sys.argv[2]), Path(sys.argv[3]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-corpus", action="store_true")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tp2", action="store_true", help="also the TP=2 repro through the agents (minutes)")
    ap.add_argument("--write", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args()
    lines: list[str] = []
    if not args.skip_corpus:
        lines += corpus(args.only)
    if not args.skip_vllm:
        from agent_vllm import vllm_rounds  # the real-vLLM half (its own file: it needs tests/vllm)

        lines += vllm_rounds(args.rounds)
        if args.tp2:
            from agent_vllm import tp2_repro

            lines += tp2_repro()
    result = " ".join(ln.split(" ", 1)[1] for ln in lines if ln.startswith("RESULT_"))
    print(f"RESULT {result}")
    if args.write:
        args.write.write_text("\n".join(lines) + f"\nRESULT {result}\n", encoding="utf-8")


if __name__ == "__main__":
    main()
