"""The kvcached build fingerprint of each engine's own interpreter, not kvdiag's.

A real venv (``python -m venv``) imports the pre-fix kvcached fixture through a ``.pth`` file;
kvdiag's own interpreter does not see it. The record, ``kvdiag doctor`` and a captured pid must
judge the engine's build (pre-fix), labelled whose, while kvdiag's own stays "not installed".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdiag.environment import interpreter as interp
from kvdiag.environment.interpreter import engines_packages, packages_of, pid_packages
from kvdiag.kvcached.build import installed_kvcached

ROOT = Path(__file__).resolve().parents[2]
PREFIX = ROOT / "tests" / "fixtures" / "kvcached_prefix"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def engine_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv whose interpreter imports the pre-fix kvcached fixture (and a `vllm` script, for kind vllm)."""
    if installed_kvcached().installed:
        pytest.skip("kvdiag's own interpreter has a kvcached: the test needs one without")
    venv = tmp_path_factory.mktemp("engine") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "kvcached_fixture.pth").write_text(f"{PREFIX}\n", encoding="utf-8")
    vllm = venv / "bin" / "vllm"
    vllm.write_text(f"#!{venv / 'bin' / 'python'}\nraise SystemExit('not a real vLLM')\n", encoding="utf-8")
    vllm.chmod(0o755)
    return venv


def test_the_engine_interpreters_build_is_judged_not_kvdiags(engine_venv: Path) -> None:
    py = str(engine_venv / "bin" / "python")
    rec = packages_of("engine vlm", py)
    assert rec.source == "asked the interpreter"
    assert rec.kvcached is not None and rec.kvcached.verdict == "pre_fix"
    assert rec.kvcached.location == str(PREFIX / "kvcached")
    assert installed_kvcached().verdict == "absent"            # kvdiag's own interpreter: none
    # cached per interpreter: engines sharing it are asked once and share one record
    started = len(interp._cache)
    (shared,) = engines_packages([("coder", py), ("vlm", py)])
    assert len(interp._cache) == started and shared.engines == ["coder", "vlm"]
    assert shared.kvcached is not None and shared.kvcached.verdict == "pre_fix"


def test_an_interpreter_that_hangs_is_bounded_and_read_from_site_packages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / "venv"
    site = venv / "lib" / f"python3.{sys.version_info.minor}" / "site-packages"
    (site / "kvcached").mkdir(parents=True)
    for name in ("__init__.py", "kv_cache_manager.py", "tp_ipc_util.py"):
        (site / "kvcached" / name).write_bytes((PREFIX / "kvcached" / name).read_bytes())
    (venv / "bin").mkdir()
    hanging = venv / "bin" / "python"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(0o755)
    monkeypatch.setattr(interp, "QUERY_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    rec = packages_of("engine slow", str(hanging))
    assert time.monotonic() - t0 < 30
    assert rec.source == "read from site-packages" and "did not answer" in rec.note
    assert rec.kvcached is not None and rec.kvcached.verdict == "pre_fix"
    assert rec.kvcached.location == str(site / "kvcached")


def test_doctor_judges_the_scenario_engines_kvcached(engine_venv: Path, tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"name: engine-venv\nengines:\n  - name: vlm\n    kind: vllm\n    model: /models/tiny\n"
                        f"    python: {engine_venv}\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "doctor", "--scenario", str(scenario), "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 10, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    (ip,) = data["environment"]["engine_packages"]
    assert ip["engines"] == ["vlm"] and ip["python"] == str(engine_venv / "bin" / "python")
    assert ip["kvcached"]["verdict"] == "pre_fix"
    assert data["environment"]["kvcached"]["installed"] is False
    rows = {c["subject"]: c for c in data["checks"] if c["check"] == "allocator_build"}
    engine_row = rows[f"kvcached of engine vlm ({engine_venv / 'bin' / 'python'})"]
    assert engine_row["status"] == "risk" and "#371" in (engine_row["upstream"] or "")
    assert rows["installed kvcached"]["status"] == "n/a"
    text = subprocess.run([sys.executable, "-m", "kvdiag", "doctor", "--scenario", str(scenario)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
    assert "kvcached of engine vlm" in text and "kvcached (kvdiag's Python): not installed" in text


def test_a_captured_pids_interpreter_is_judged(engine_venv: Path, tmp_path: Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text("import sys, time\nprint('ready', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([str(engine_venv / "bin" / "python"), str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        rec = pid_packages(proc.pid)
        assert rec.who == f"pid {proc.pid}" and rec.python == str(engine_venv / "bin" / "python")
        assert rec.kvcached is not None and rec.kvcached.verdict == "pre_fix"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_command_engines_interpreters_are_recorded(engine_venv: Path, tmp_path: Path) -> None:
    """Three `kind: command` engines on the venv's Python: argv[0] python, a bin/ script with a python
    #! line (both known before launch), and a shell wrapper that execs it (known from /proc after launch)."""
    from kvcli import HEALTH_SERVER, run_kvdiag

    py = engine_venv / "bin" / "python"
    server = tmp_path / "health.py"
    server.write_text(HEALTH_SERVER)
    script = engine_venv / "bin" / "kvdiag-test-server"
    script.write_text(f"#!{py}\n" + HEALTH_SERVER)
    script.chmod(0o755)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"""
name: command-interpreters
windows: {{stall_s: 20, startup_timeout_s: 120, timeout_s: 150, poll_s: 0.2, kill_grace_s: 0.5}}
capture: {{when: never}}
engines:
  - name: direct
    kind: command
    command: ["{py}", "{server}", "{{port}}"]
    expect: healthy
  - name: script
    kind: command
    command: ["{script}", "{{port}}"]
    expect: healthy
  - name: wrapped
    kind: command
    command: [/bin/sh, -c, 'exec "$0" "$1" "$2"', "{py}", "{server}", "{{port}}"]
    expect: healthy
""")
    out = tmp_path / "out"
    proc = run_kvdiag("repro", "two-engine", "--scenario", str(scenario), "--out", str(out), timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    env = json.loads((out / "bundle" / "bundle.json").read_text())["environment"]
    (ip,) = env["engine_packages"]            # one interpreter, all three engines
    assert ip["python"] == str(py) and sorted(ip["engines"]) == ["direct", "script", "wrapped"]
    assert ip["source"] == "asked the interpreter" and ip["kvcached"]["verdict"] == "pre_fix"
    assert env["kvcached"]["installed"] is False
    md = (out / "report.md").read_text()
    assert f"kvcached (engine direct, script, wrapped: {py}) at {PREFIX / 'kvcached'}: pre_fix" in md


def test_a_captured_pid_is_judged_by_the_kvcached_it_has_loaded(tmp_path: Path) -> None:
    """A process that loaded a kvcached extension module runs that build, whatever its sys.path says now."""
    import _json  # any real extension module stands in for kvcached's vmm_ops

    if installed_kvcached().installed:
        pytest.skip("kvdiag's own interpreter has a kvcached: the test needs one without")
    pkg = tmp_path / "elsewhere" / "kvcached"
    pkg.mkdir(parents=True)
    for name in ("__init__.py", "kv_cache_manager.py", "tp_ipc_util.py"):
        (pkg / name).write_bytes((PREFIX / "kvcached" / name).read_bytes())
    so = pkg / "vmm_ops.so"
    so.write_bytes(Path(str(_json.__file__)).read_bytes())
    script = tmp_path / "engine.py"
    script.write_text(f"import ctypes, sys\nctypes.CDLL({str(so)!r})\nprint('ready', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        rec = pid_packages(proc.pid)
        assert rec.kvcached is not None and rec.kvcached.location == str(pkg)
        assert rec.kvcached.verdict == "pre_fix" and "binary" in rec.kvcached.sources
    finally:
        proc.kill()
        proc.wait(timeout=30)
