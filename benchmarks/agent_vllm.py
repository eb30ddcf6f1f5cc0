"""The real-vLLM half of benchmarks/agent.py: tokens/s armed vs not, agent answer time per process, and the
plugin's injected GIL cycle named through the agent alone (capture under the seccomp filter)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from vllmserver import VllmServer  # noqa: E402

from kvdiag.agent.protocol import ENABLE_ENV  # noqa: E402
from kvdiag.capture.agent import armed, request_dump  # noqa: E402
from kvdiag.launch.vllm import agent_library, find_vllm  # noqa: E402
from kvdiag.osread.process import read_comm  # noqa: E402

NO_PTRACE = ROOT / "tests" / "fixtures" / "no_ptrace.py"
STALL_AFTER_S = 75.0
MAX_TOKENS = 48


class ArmedServer(VllmServer):
    def env(self) -> dict[str, str]:
        env = super().env()
        env[ENABLE_ENV] = "1"
        lib = agent_library()
        if lib:
            env["KVDIAG_AGENT_NATIVE"] = lib
        return env


def _complete(url: str, model: str, timeout_s: float = 60.0) -> float:
    """tokens/s of one completion of MAX_TOKENS tokens."""
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "The quick brown fox", "max_tokens":
                                                   MAX_TOKENS, "temperature": 0, "ignore_eos": True},
                   timeout=timeout_s, trust_env=False)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"]) / (time.monotonic() - t0)


def vllm_rounds(rounds: int) -> list[str]:
    try:
        find_vllm(None)
    except Exception as exc:  # noqa: BLE001 - the corpus half still stands
        return [f"vllm: skipped ({exc})"]
    lines: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-agent-vllm-"))
    plain = VllmServer(tmp / "plain.log")
    arm = ArmedServer(tmp / "armed.log", stall_after_s=STALL_AFTER_S)
    try:
        arm.start()
        plain.start()
        for s in (arm, plain):
            if not s.wait_ready(300):
                last = next((ln for ln in reversed(s.log_text().splitlines()) if ln.strip()), "")
                return [f"vllm: a server did not start: {last[-300:]}"]
        ready = time.monotonic()
        model = plain.model
        for s in (arm, plain):
            _complete(s.url, model)   # warm up
        pairs: list[tuple[float, float]] = []
        for i in range(rounds):
            order = (arm, plain) if i % 2 == 0 else (plain, arm)
            got = {id(s): _complete(s.url, model) for s in order}
            pairs.append((got[id(arm)], got[id(plain)]))
        ratios = [a / p for a, p in pairs]
        armed_tps, plain_tps = statistics.median(a for a, _ in pairs), statistics.median(p for _, p in pairs)
        lines.append(f"vllm TP=1 tokens/s, {rounds} paired rounds of {MAX_TOKENS} tokens: armed median "
                     f"{armed_tps:.1f}, not armed {plain_tps:.1f}; "
                     f"paired ratio armed/not median {statistics.median(ratios):.3f} "
                     f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
        per_proc: list[str] = []
        dump_ms: list[float] = []
        for pid in arm.tree():
            a, why = armed(pid)
            if a is None:
                per_proc.append(f"  pid {pid} ({read_comm(pid)}): not armed ({why})")
                continue
            times = []
            for _ in range(20):
                out = request_dump(pid, a, 5.0)
                if out.text is not None:
                    times.append(out.duration_s * 1000)
            dump_ms += times
            per_proc.append(f"  pid {pid} ({read_comm(pid)}): {len(times)}/20 dumps, p50 "
                            f"{statistics.median(times) if times else 0:.1f} ms, max {max(times, default=0):.1f} ms")
        lines.append("agent dump latency per process of the armed vLLM (request to complete file read):")
        lines += per_proc
        # The injected GIL cycle: the first request after STALL_AFTER_S builds the stock pool and hangs.
        time.sleep(max(0.0, ready + STALL_AFTER_S + 2 - time.monotonic()))
        threading.Thread(target=lambda: _swallow(arm.url, model), daemon=True).start()
        time.sleep(8)
        core = arm.engine_core_pid()
        env = {k: v for k, v in os.environ.items() if k != ENABLE_ENV}
        r = subprocess.run([sys.executable, str(NO_PTRACE), str(Path(sys.executable).parent / "kvdiag"), "capture",
                            "--pid", str(core), "--json", "--out", str(tmp / "gil")], capture_output=True, text=True,
                           timeout=120, env=env)
        verdict = json.loads(r.stdout)["verdict"] if r.stdout.strip().startswith("{") else {}
        via = [ln for ln in r.stderr.splitlines() if "agent" in ln]
        lines.append(f"injected GIL cycle in the armed EngineCore (pid {core}), capture under the seccomp filter: "
                     f"exit {r.returncode}, verdict {verdict.get('kind')}: {str(verdict.get('summary', ''))[:220]}")
        lines += [f"  {v}" for v in via[:3]]
        ok = verdict.get("kind") == "gil_cycle"
        lines.append(f"RESULT_VLLM tokens_ratio={statistics.median(ratios):.3f} dump_ms_p50="
                     f"{statistics.median(dump_ms) if dump_ms else 0:.1f} tp1_gil_cycle_named={int(ok)}")
    finally:
        for s in (arm, plain):
            s.stop()
    for ln in lines:
        print(ln, flush=True)
    return lines


def _swallow(url: str, model: str) -> None:
    try:
        _complete(url, model, timeout_s=120)
    except Exception:  # noqa: BLE001 - it hangs by design; the server is torn down under it
        pass


def tp2_repro() -> list[str]:
    """TP=2: the shipped tp2 scenario (the plugin hangs rank 1 in its worker while serving), run by a kvdiag under
    the seccomp filter with every engine process armed: the stuck rank named through the agents alone."""
    out = Path(tempfile.mkdtemp(prefix="kvdiag-agent-tp2-"))
    env = {**os.environ, ENABLE_ENV: "1"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(NO_PTRACE), str(Path(sys.executable).parent / "kvdiag"), "repro",
                        "two-engine", "--scenario", str(ROOT / "scenarios" / "tp2-vllm-cpu.yaml"), "--out", str(out)],
                       capture_output=True, text=True, timeout=1200, env=env)
    try:
        report = json.loads((out / "report.json").read_text())
        bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    except (OSError, ValueError):
        return [f"vllm TP=2: no report (exit {r.returncode}): {r.stderr[-300:]}"]
    verdict = report["verdict"]
    via = sorted({f["pid"] for f in bundle["findings"] if f["kind"] == "capture_path"})
    agent = [t["duration_s"] for p in bundle["processes"] for t in p["tools"] if t["tool"] == "agent" and t["ok"]]
    lines = [f"vllm TP=2 (repro tp2-vllm-cpu under the seccomp filter, engines armed, {time.monotonic() - t0:.0f}s): "
             f"exit {r.returncode}, verdict {verdict['kind']}: {verdict['summary'][:240]}",
             f"  processes read through the agent: {len(via)} (pids {', '.join(map(str, via))}); agent dumps "
             f"{len(agent)}, p50 {statistics.median(agent) * 1000 if agent else 0:.0f} ms",
             f"RESULT_TP2 tp2_gil_cycle_named={int(verdict['kind'] == 'gil_cycle')}"]
    for ln in lines:
        print(ln, flush=True)
    return lines
