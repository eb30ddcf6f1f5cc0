"""The real-vLLM half of benchmarks/agent.py: tokens/s armed vs not, agent answer time per process, and the
plugin's injected GIL cycle named through the agent alone (capture under the seccomp filter), TP=1 and TP=2.

Everything here starts in the background first (:func:`start`) so that the corpus half runs while vLLM boots;
the measured rounds run once the corpus is done, on a machine with nothing else of the benchmark running.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from vllmserver import VllmServer  # noqa: E402

from kvdiag.agent.protocol import ENABLE_ENV, agent_dir, prune_stale  # noqa: E402
from kvdiag.capture.agent import armed, request_dump  # noqa: E402
from kvdiag.launch.vllm import agent_library, find_vllm  # noqa: E402
from kvdiag.osread.process import read_comm  # noqa: E402
from kvdiag.vllm_plugin import STALL_ENV, STALL_WHEN_ENV  # noqa: E402

NO_PTRACE = ROOT / "tests" / "fixtures" / "no_ptrace.py"
MAX_TOKENS = 32
DUMPS_PER_PROCESS = 20
STALL_LOG = "growing the pool by a stock engine-2 pool"


class ArmedServer(VllmServer):
    """`vllm serve` with KVDIAG_AGENT=1; the plugin's GIL cycle held back until ``stall_file`` exists."""

    def __init__(self, log_path: Path, stall_file: Path) -> None:
        super().__init__(log_path)
        self.stall_file = stall_file

    def env(self) -> dict[str, str]:
        env = super().env()
        env[ENABLE_ENV] = "1"
        env[STALL_ENV] = "0"
        env[STALL_WHEN_ENV] = str(self.stall_file)
        lib = agent_library()
        if lib:
            env["KVDIAG_AGENT_NATIVE"] = lib
        return env


@dataclass
class Vllm:
    """The background vLLM work of one benchmark run: two TP=1 servers, and the TP=2 repro."""

    tmp: Path
    arm: ArmedServer | None = None
    plain: VllmServer | None = None
    tp2: subprocess.Popen[str] | None = None
    tp2_out: Path | None = None
    tp2_started: float = 0.0
    skipped: str | None = None
    lines: list[str] = field(default_factory=list)

    def say(self, *lines: str) -> None:
        self.lines += lines
        for ln in lines:
            print(ln, flush=True)


def start(tp1: bool, tp2: bool) -> Vllm:
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-agent-vllm-"))
    run = Vllm(tmp)
    try:
        find_vllm(None)
    except Exception as exc:  # noqa: BLE001 - the corpus half still stands
        run.skipped = f"vllm: skipped ({exc})"
        return run
    if tp2:
        # The shipped TP=2 scenario (rank 1 hangs in its worker while serving) run by a kvdiag under the seccomp
        # filter with every engine process armed: its own engines, ports and /dev/shm names.
        run.tp2_out = tmp / "tp2"
        run.tp2_started = time.monotonic()
        run.tp2 = subprocess.Popen(
            [sys.executable, str(NO_PTRACE), str(Path(sys.executable).parent / "kvdiag"), "repro", "two-engine",
             "--scenario", str(ROOT / "scenarios" / "tp2-vllm-cpu.yaml"), "--out", str(run.tp2_out)],
            stdout=subprocess.DEVNULL, stderr=open(tmp / "tp2.err", "w"),  # noqa: SIM115 - closed with the child
            text=True, env={**os.environ, ENABLE_ENV: "1"}, start_new_session=True)
    if tp1:
        run.arm = ArmedServer(tmp / "armed.log", tmp / "stall")
        run.plain = VllmServer(tmp / "plain.log")
        run.arm.start()
        run.plain.start()
    return run


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds the threads of ``pids`` have run so far (schedstat: nanoseconds, not 10 ms ticks)."""
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as fh:
                    total += int(fh.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def _complete(url: str, model: str, timeout_s: float = 60.0, tree: list[int] | None = None) -> tuple[float, float]:
    """One completion of MAX_TOKENS tokens: (tokens per wall second, tokens per CPU second of ``tree``)."""
    c0 = _cpu_s(tree) if tree else 0.0
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "The quick brown fox", "max_tokens":
                                                   MAX_TOKENS, "temperature": 0, "ignore_eos": True},
                   timeout=timeout_s, trust_env=False)
    r.raise_for_status()
    wall = time.monotonic() - t0
    cpu = _cpu_s(tree) - c0 if tree else 0.0
    tokens = int(r.json()["usage"]["completion_tokens"])
    return tokens / wall, tokens / cpu if cpu > 0 else 0.0


def _median_ci(values: list[float], seed: int = 43, draws: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of the median (fixed seed: the same rounds give the same interval)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def overhead(pairs: list[tuple[float, float]], what: str, unit: str) -> tuple[list[str], dict[str, float]]:
    """Paired rounds (armed, not) judged: armed/not per round, its median and 95 % interval, and the same-server
    noise floor (each server against itself in the next round, as far apart as an armed/not pair)."""
    ratios = [a / p for a, p in pairs if a > 0 and p > 0]
    if not ratios:
        return [f"{what}: no rounds"], {"ratio": 0.0, "lo": 0.0, "hi": 0.0, "within": 0.0}
    lo, hi = _median_ci(ratios)
    same = [pairs[i][k] / pairs[i + 1][k] for k in (0, 1) for i in range(len(pairs) - 1)
            if pairs[i][k] > 0 and pairs[i + 1][k] > 0]
    floor = statistics.median(abs(math.log(r)) for r in same) if same else 0.0
    med = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (med, med, med)
    within = lo <= 1.0 <= hi
    lines = [f"{what}: armed median {statistics.median(a for a, _ in pairs):.1f} {unit}, not armed "
             f"{statistics.median(p for _, p in pairs):.1f}; armed/not per round median {med:.3f}, 95% CI "
             f"{lo:.3f}..{hi:.3f}, IQR {q1:.3f}..{q3:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}; a server "
             f"against itself one round later: median |change| {math.expm1(floor):.1%}; "
             f"{'within noise (the interval holds 1.0)' if within else 'NOT within noise'}"]
    return lines, {"ratio": med, "lo": lo, "hi": hi, "within": float(within)}


def rounds(run: Vllm, pairs: int, budget_s: float) -> None:
    """Paired rounds, per-process dump latency and the injected GIL cycle on the TP=1 servers; then both are
    stopped. Appends to ``run.lines`` (and a RESULT_VLLM line)."""
    arm, plain = run.arm, run.plain
    if arm is None or plain is None:
        return
    try:
        for s in (arm, plain):
            if not s.wait_ready(300):
                last = next((ln for ln in reversed(s.log_text().splitlines()) if ln.strip()), "")
                run.say(f"vllm: a server did not start: {last[-300:]}")
                return
        model = plain.model
        for s in (arm, plain, arm, plain):
            _complete(s.url, model)   # warm up
        trees = {id(s): s.tree() for s in (arm, plain)}
        wall: list[tuple[float, float]] = []
        cpu: list[tuple[float, float]] = []
        deadline = time.monotonic() + budget_s
        for i in range(pairs):
            if time.monotonic() > deadline:
                break
            order = (arm, plain) if i % 2 == 0 else (plain, arm)
            got = {id(s): _complete(s.url, model, tree=trees[id(s)]) for s in order}
            wall.append((got[id(arm)][0], got[id(plain)][0]))
            cpu.append((got[id(arm)][1], got[id(plain)][1]))
        run.say(f"vllm TP=1, {len(wall)} paired rounds of {MAX_TOKENS} tokens, interleaved (A B | B A | ...), "
                "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()) + ":")
        text, figures = overhead(wall, "  tokens/s", "tokens/s")
        run.say(*text)
        # The same rounds in CPU time of each server's processes: what the armed agent could cost them, with
        # the other tenants' share of the two cores left out (wall time on a shared machine is mostly theirs).
        text, per_cpu = overhead(cpu, "  tokens per CPU second of the server's processes", "tokens/CPU-s")
        run.say(*text)
        per_proc: list[str] = []
        dump_ms: list[float] = []
        for pid in arm.tree():
            a, why = armed(pid)
            if a is None:
                per_proc.append(f"  pid {pid} ({read_comm(pid)}): not armed ({why})")
                continue
            times = []
            for _ in range(DUMPS_PER_PROCESS):
                out = request_dump(pid, a, 5.0)
                if out.text is not None:
                    times.append(out.duration_s * 1000)
            dump_ms += times
            per_proc.append(f"  pid {pid} ({read_comm(pid)}): {len(times)}/{DUMPS_PER_PROCESS} dumps, p50 "
                            f"{statistics.median(times) if times else 0:.1f} ms, max {max(times, default=0):.1f} ms")
        run.say("agent dump latency per process of the armed vLLM (request to complete file read):", *per_proc)
        named = _inject_and_capture(arm, model, run.tmp)
        run.say(*named[1])
        run.say(f"RESULT_VLLM tokens_ratio={figures['ratio']:.3f} tokens_ratio_ci={figures['lo']:.3f}.."
                f"{figures['hi']:.3f} cpu_tokens_ratio={per_cpu['ratio']:.3f} cpu_tokens_ratio_ci={per_cpu['lo']:.3f}.."
                f"{per_cpu['hi']:.3f} overhead_within_noise={int(figures['within'] and per_cpu['within'])} "
                f"dump_ms_p50={statistics.median(dump_ms) if dump_ms else 0:.1f} tp1_gil_cycle_named={int(named[0])}")
    finally:
        for s in (arm, plain):
            s.stop()
        _prune()


def _prune() -> None:
    """The armed records of the servers' processes that stop() had to SIGKILL (the hung EngineCore): kvdiag
    removes them as any later capture would."""
    gone = prune_stale(agent_dir())
    if gone:
        print(f"removed {len(gone)} armed record(s) left by SIGKILLed processes: {', '.join(gone)}", flush=True)


def _inject_and_capture(arm: ArmedServer, model: str, tmp: Path) -> tuple[bool, list[str]]:
    """The plugin's GIL cycle in the armed EngineCore (the next request after the stall file appears), captured
    by a kvdiag under the seccomp filter: named through the agent alone."""
    arm.stall_file.touch()
    threading.Thread(target=_swallow, args=(arm.url, model), daemon=True).start()
    deadline = time.monotonic() + 30
    while STALL_LOG not in arm.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)   # the EngineCore main thread reaches the cycle right after logging it
    core = arm.engine_core_pid()
    env = {k: v for k, v in os.environ.items() if k != ENABLE_ENV}
    r = subprocess.run([sys.executable, str(NO_PTRACE), str(Path(sys.executable).parent / "kvdiag"), "capture",
                        "--pid", str(core), "--json", "--out", str(tmp / "gil")], capture_output=True, text=True,
                       timeout=120, env=env)
    verdict = json.loads(r.stdout)["verdict"] if r.stdout.strip().startswith("{") else {}
    via = [ln for ln in r.stderr.splitlines() if "agent" in ln]
    lines = [f"injected GIL cycle in the armed EngineCore (pid {core}), capture under the seccomp filter: "
             f"exit {r.returncode}, verdict {verdict.get('kind')}: {str(verdict.get('summary', ''))[:220]}"]
    lines += [f"  {v}" for v in via[:3]]
    return verdict.get("kind") == "gil_cycle", lines


def _swallow(url: str, model: str) -> None:
    try:
        _complete(url, model, timeout_s=120)
    except Exception:  # noqa: BLE001 - it hangs by design; the server is torn down under it
        pass


def tp2_result(run: Vllm, timeout_s: float = 600.0) -> None:
    """Wait (bounded) for the TP=2 repro started by :func:`start` and read its report."""
    proc, out = run.tp2, run.tp2_out
    if proc is None or out is None:
        return
    try:
        rc = proc.wait(timeout=max(1.0, run.tp2_started + timeout_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)   # kvdiag tears its engines down on SIGTERM
        rc = proc.wait(timeout=60)
    took = time.monotonic() - run.tp2_started
    try:
        report = json.loads((out / "report.json").read_text())
        bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    except (OSError, ValueError):
        err = (run.tmp / "tp2.err").read_text(errors="replace")[-300:]
        run.say(f"vllm TP=2: no report (exit {rc}): {err}", "RESULT_TP2 tp2_gil_cycle_named=0")
        return
    verdict = report["verdict"]
    via = sorted({f["pid"] for f in bundle["findings"] if f["kind"] == "capture_path"})
    agent = [t["duration_s"] for p in bundle["processes"] for t in p["tools"] if t["tool"] == "agent" and t["ok"]]
    run.say(
        f"vllm TP=2 (repro tp2-vllm-cpu under the seccomp filter, engines armed, {took:.0f}s, beside the rest): "
        f"exit {rc}, verdict {verdict['kind']}: {verdict['summary'][:240]}",
        f"  processes read through the agent: {len(via)} (pids {', '.join(map(str, via))}); agent dumps "
        f"{len(agent)}, p50 {statistics.median(agent) * 1000 if agent else 0:.0f} ms",
        f"RESULT_TP2 tp2_gil_cycle_named={int(verdict['kind'] == 'gil_cycle')}")


def stop(run: Vllm) -> None:
    """Whatever is still running (an interrupted benchmark)."""
    for s in (run.arm, run.plain):
        if s is not None and s.popen is not None and s.popen.poll() is None:
            s.stop()
    if run.tp2 is not None and run.tp2.poll() is None:
        os.killpg(run.tp2.pid, 15)
        try:
            run.tp2.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(run.tp2.pid, 9)
