"""What a new user tripped on (third pass): each test failed before its fix."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvcli import read_report, run_kvdiag

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "hangers"))
import hanger_kit as hk  # noqa: E402

# A soak engine's banner: prealloc on, a pool far above min_reserved_pages. Nothing hangs at start-up,
# but a stock kvcached hangs once load fills the pool (the soak that then stalled printed this).
SOAK_BANNER = ("INFO 12-05 10:00:01 Init C++ PageAllocator: num_layers=28, mem_size_per_layer=512MB, "
               "total_mem_size=28672MB, page_size=2MB, world_size=1, pp_rank=0, async_sched=0, "
               "contiguous_layout=1, enable_prealloc=1, num_kv_buffers=2, group_id=0, "
               "min_reserved_pages=5, max_reserved_pages=10")


def test_doctor_log_judges_a_banner_as_banner_does(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(SOAK_BANNER + "\n")
    banner = run_kvdiag("banner", str(log))
    assert banner.returncode == 10, banner.stdout + banner.stderr
    assert "RISK under load" in banner.stdout
    doctor = run_kvdiag("doctor", "--log", str(log), "--json")
    assert doctor.returncode == 10, doctor.stdout[-2000:] + doctor.stderr
    rows = [c for c in json.loads(doctor.stdout)["checks"] if c["check"] == "prealloc_pool"]
    assert rows and rows[0]["status"] == "risk", rows
    assert "load fills the KV pool" in rows[0]["detail"]


def test_banner_off_is_no_risk(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(SOAK_BANNER.replace("enable_prealloc=1", "enable_prealloc=0") + "\n")
    banner = run_kvdiag("banner", str(log))
    assert banner.returncode == 0, banner.stdout + banner.stderr
    doctor = run_kvdiag("doctor", "--log", str(log), "--json")
    rows = [c for c in json.loads(doctor.stdout)["checks"] if c["check"] == "prealloc_pool"]
    assert rows and rows[0]["status"] == "ok", rows


def test_doctor_says_what_its_logs_judged(tmp_path: Path) -> None:
    """`doctor --log` was told "no scenario given: pass --scenario FILE (or --log LOG)", and a log without a
    banner read "no known risk applies" as if it had been judged; the closing count named three checks
    for four risks."""
    bare, engine = tmp_path / "bare.log", tmp_path / "engine.log"
    bare.write_text("INFO server started\n")
    engine.write_text(SOAK_BANNER + "\n")
    doctor = run_kvdiag("doctor", "--log", str(bare), "--log", str(engine))
    assert doctor.returncode == 10, doctor.stdout[-2000:] + doctor.stderr
    text = " ".join(doctor.stdout.split())    # the terminal's wrapping undone
    assert "no scenario given" not in text and f"logs: {bare}, {engine}" in text
    assert f"unknown prealloc_pool log {bare}" in text and "no `Init C++ PageAllocator` banner" in text
    assert doctor.stdout.strip().splitlines()[-1] == "1 known risk(s) apply: prealloc_pool (exit 10)"
    plan = run_kvdiag("doctor", "--scenario", "two-engine")
    last = plan.stdout.strip().splitlines()[-1]
    risks = sum(1 for ln in plan.stdout.splitlines() if ln.startswith("risk "))
    named = last.split(": ", 1)[1].rsplit(" (exit", 1)[0].split(", ")
    assert risks == sum(int(n.split(" ×")[1]) if " ×" in n else 1 for n in named), plan.stdout
    assert last.startswith(f"{len(named)} known risk(s) apply: "), last


def _umask_run(args: list[str], umask: int) -> subprocess.CompletedProcess[str]:
    code = (f"import os, runpy, sys; os.umask({umask:#o}); sys.argv = ['kvdiag', *{args!r}]; "
            "runpy.run_module('kvdiag', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_reports_follow_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    bundle = Path(__file__).resolve().parents[1] / "fixtures" / "bundles" / "lock_inversion"
    out = tmp_path / "out.html"
    done = _umask_run(["report", str(bundle), "--html", str(out)], umask)
    assert done.returncode == 0, done.stdout + done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == mode
    folder = tmp_path / "cap"
    done = _umask_run(["analyze", str(bundle), "--json"], umask)
    assert done.returncode in (0, 10), done.stderr
    # a whole output folder: every file the user may hand a colleague
    done = _umask_run(["repro", "two-engine", "--allocator", "fixed", "--out", str(folder)], umask)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert files
    bad = {str(p.relative_to(folder)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files
           if stat.S_IMODE(p.stat().st_mode) != mode}
    assert not bad, bad


@pytest.mark.parametrize("kind", ["lock_inversion_py2", "healthy_idle"])
def test_every_stack_tool_missing_is_no_evidence_said_first(tmp_path: Path, kind: str) -> None:
    """No py-spy, pystack or gdb on PATH: /proc alone reads thread states, which tell a deadlock from an
    idle server no better than a guess. Exit 3, never a deadlock or healthy, and the missing tools first."""
    with hk.running(kind) as h:
        out = tmp_path / kind
        # The system interpreter with this checkout and the venv's packages: no tool beside it or on PATH.
        site = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
        if not system.exists():
            pytest.skip(f"{system} is not installed")
        # kvdiag also looks beside its interpreter and under its prefix (gdb sits in /usr/bin): a bare venv.
        subprocess.run([str(system), "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=60)
        python = tmp_path / "bare" / "bin" / "python"
        env = {"PATH": str(tmp_path / "empty-path"), "HOME": str(tmp_path), "LANG": "C.UTF-8",
               "PYTHONPATH": f"{ROOT}:{site}", "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.run([str(python), "-m", "kvdiag", "capture", "--pid", str(h.pid), "--out", str(out)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    report = read_report(out)
    verdict = report["verdict"]
    assert isinstance(verdict, dict) and verdict["kind"] == "no_evidence", verdict
    headline = proc.stdout.strip().splitlines()[1]     # the line after "verdict: no_evidence"
    assert "py-spy, pystack, gdb not installed" in headline, proc.stdout


def test_banner_without_a_banner_judges_nothing(tmp_path: Path) -> None:
    log = tmp_path / "plain.log"
    log.write_text("INFO nothing to see here\n")
    done = run_kvdiag("banner", str(log))
    assert done.returncode == 5, done.stdout + done.stderr
    assert "nothing judged" in done.stdout


def test_watch_once_of_a_server_never_reached_judges_nothing(tmp_path: Path) -> None:
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run_kvdiag("watch", "--url", f"http://127.0.0.1:{port}", "--once", "--duration", "3",
                      "--out", str(tmp_path / "w"), timeout=60)
    assert done.returncode == 5, done.stdout + done.stderr
    stop = [json.loads(line) for line in done.stdout.splitlines() if '"stop"' in line]
    assert stop and stop[-1].get("never_reached"), done.stdout
    assert "never answered" in done.stderr


@pytest.mark.parametrize("args", [["sweep", "--vary", "prealloc=0,1"], ["ab", "--repeat", "2"]])
def test_unwritable_out_is_a_usage_error(tmp_path: Path, args: list[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = run_kvdiag(*args, "--out", str(blocker / "out"), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot write output folder" in done.stderr and "internal error" not in done.stderr


@pytest.mark.parametrize("args", [["repro", "two-engine"], ["soak", "--model", "sim", "--duration", "60"]])
def test_an_interrupted_run_prints_its_outcome_on_stdout(tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "kvdiag", *args, "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "bundle").is_dir() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3.0)       # engines are starting
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stdout + stderr
    assert "exit code 130" in stdout and f"report.json: {out / 'report.json'}" in stdout, stdout + stderr
    assert "interrupted" in stdout


def test_a_mistyped_command_is_suggested_once() -> None:
    done = run_kvdiag("captur", timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("Did you mean") == 1, done.stderr


def test_watch_errors_carry_one_prefix(tmp_path: Path) -> None:
    with socket.socket() as taken:       # the metrics port is already in use: an OSError, one line
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = run_kvdiag("watch", "--url", "http://127.0.0.1:9", "--metrics-port", str(taken.getsockname()[1]),
                          "--metrics-addr", "127.0.0.1", "--duration", "1", "--out", str(tmp_path / "w"), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "kvdiag watch: kvdiag watch:" not in done.stderr and "watch: watch:" not in done.stderr, done.stderr


def test_watch_and_soak_give_one_stalled_server_one_verdict_and_signature(tmp_path: Path) -> None:
    """`soak --url` then `watch --once` on the same wedged server: the same kind and signature (a new user saw
    watch say gil_cycle and soak decode_stall). The watch's bundle now records the server it watched as an
    engine that served and stalled even where no log file is found, as soak records it."""
    import uuid

    from kvdiag.allocator import remove_device_files
    from kvdiag.sim.harness import SimProcess
    dev = f"kvnew{uuid.uuid4().hex[:10]}"
    sp = SimProcess(tmp_path / "server.log", preset="decode-stall", allocator="stock", device_name=dev)
    try:
        with sp:
            assert sp.wait_healthy(30), sp.log_text()[-2000:]
            soak = run_kvdiag("soak", "--url", sp.url, "--duration", "60", "--out", str(tmp_path / "soak"),
                              timeout=180)
            assert soak.returncode == 10, soak.stdout[-2000:] + soak.stderr[-2000:]
            watch = run_kvdiag("watch", "--url", sp.url, "--once", "--window", "3", "--duration", "60",
                               "--out", str(tmp_path / "watch"), timeout=180)
            assert watch.returncode == 10, watch.stdout[-2000:] + watch.stderr[-2000:]
    finally:
        remove_device_files(dev)
    soaked = read_report(tmp_path / "soak")["verdict"]
    verdict = next(json.loads(ln) for ln in watch.stdout.splitlines() if '"event": "verdict"' in ln)
    watched_report = read_report(Path(verdict["out"]))
    watched = watched_report["verdict"]
    engines = watched_report["engines"]
    assert isinstance(engines, list) and engines[0]["name"] == sp.url.split("//", 1)[1].rstrip("/"), engines
    assert isinstance(soaked, dict) and isinstance(watched, dict)
    assert watched["kind"] == soaked["kind"], (watched["summary"], soaked["summary"])
    assert watched["signature"] == soaked["signature"], (watched, soaked)
    # watch's report plots the minutes of /metrics it kept, with the stall marked, as a soak's does
    html = (Path(verdict["out"]) / "report.html").read_text()
    assert "What the watch saw" in html and html.count('<svg class="plot"') == 3, html[:500]
    assert "stall detected" in html and "last progress" in html


def test_a_plain_capture_report_shows_no_engine_noise(tmp_path: Path) -> None:
    bundles = ROOT / "tests" / "fixtures" / "bundles"
    plain, engine = tmp_path / "plain.html", tmp_path / "engine.html"
    assert run_kvdiag("report", str(bundles / "lock_inversion"), "--html", str(plain), timeout=60).returncode == 0
    assert run_kvdiag("report", str(bundles / "vllm_two_engine_stock"), "--html", str(engine),
                      timeout=60).returncode == 0
    shown = plain.read_text().split('id="kvdiag-report"')[0]     # the page, not its embedded JSON
    assert 'id="banners"' not in shown and "not_started" not in shown and ">external<" not in shown
    assert "no wait-for cycle" not in shown
    assert 'id="banners"' in engine.read_text()


def test_a_healthy_two_engine_repro_names_both_engines(tmp_path: Path) -> None:
    done = run_kvdiag("repro", "two-engine", "--allocator", "fixed", "--out", str(tmp_path / "r"), timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    verdict = read_report(tmp_path / "r")["verdict"]
    assert isinstance(verdict, dict) and verdict["engine"] is None
    summary = verdict["summary"]
    assert summary.startswith("all 2 engines healthy") and "coder" in summary and "vlm" in summary, summary


def test_a_gil_cycle_is_never_said_to_have_no_stuck_wait(tmp_path: Path) -> None:
    """The first command of the README names a GIL cycle and printed "waits: 0 outcome-wait(s) stuck": the
    main thread's wait on alloc_page was judged completable by another thread, the one the cycle blocks. The
    cycle's cited thread, seen not to advance, is stuck in report.json and the report's thread table."""
    with hk.running("gil_cycle", build_dir=tmp_path / "build", title="VLLM::EngineCore", bound_s=90) as h:
        done = run_kvdiag("capture", "--pid", str(h.pid), "--out", str(tmp_path / "c"), timeout=120)
    assert done.returncode == 10, done.stdout[-2000:] + done.stderr[-2000:]
    report = read_report(tmp_path / "c")
    verdict = report["verdict"]
    assert isinstance(verdict, dict) and verdict["kind"] == "gil_cycle", verdict
    cited = {(e["pid"], e["tid"]) for e in verdict["evidence"]}
    waits = report["thread_waits"]
    assert isinstance(waits, list)
    holder = [w for w in waits if (w["pid"], w["tid"]) in cited and w["purpose"] == "outcome"]
    assert holder and all(w["advanced"] is False and w["stuck"] for w in holder), waits
    md = (tmp_path / "c" / "report.md").read_text()
    assert f"| {holder[0]['pid']} | {holder[0]['tid']} | MainThread | an outcome, stuck |" in md, md
    # a plain capture's process group is named after its pid: no "engine pid-N" in the sentence
    assert "(the EngineCore)" in verdict["summary"] and "of engine pid-" not in verdict["summary"], verdict["summary"]
