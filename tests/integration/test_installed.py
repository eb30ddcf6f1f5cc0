"""A regular (non-editable) install, run from the repository root: engines must not import the checkout.

`python -m ...` puts the current folder first on sys.path; from the repository root that is the
checkout's kvdiag/ (no built _native), which shadowed the installed package in every engine kvdiag
launched (exit 4, "No module named 'kvdiag._native'"). Builds the wheel once into a fresh venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=60, check=True)
    return Path(out.stdout.strip())


def test_non_editable_install_repro_from_the_repository_root(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # kvdiag itself is built and installed for real; its dependencies come from this environment's
    # site-packages as a plain path (a .pth line does not run the editable install's hook).
    (_site_packages(python) / "kvdiag-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--config-settings=build-dir=" + str(tmp_path / "build"), str(ROOT)],
        capture_output=True, text=True, timeout=800, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    where = subprocess.run([str(python), "-c", "import kvdiag, kvdiag._native; print(kvdiag.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert where.returncode == 0 and str(venv) in where.stdout, where.stderr
    # The hazard is real: from the repository root a plain `python -c/-m` sees the checkout first.
    shadow = subprocess.run([str(python), "-c", "import kvdiag; print(kvdiag.__file__)"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert str(ROOT / "kvdiag") in shadow.stdout, shadow.stdout

    out = tmp_path / "out"
    run = subprocess.run([str(venv / "bin" / "kvdiag"), "repro", "two-engine", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 10, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["kind"] == "gil_cycle", report["verdict"]
    logs = "".join(p.read_text() for p in (out / "bundle" / "logs").glob("*.log"))
    assert "No module named" not in logs
    # The README's scenario names work from the installed package, in a folder without scenarios/.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("scenarios/two-engine-vllm-cpu.yaml", "soak-hybrid", "two-engine"):
        doctor = subprocess.run([str(venv / "bin" / "kvdiag"), "doctor", "--scenario", name, "--json"],
                                capture_output=True, text=True, timeout=120, cwd=elsewhere, env=env)
        assert doctor.returncode == 10, (name, doctor.stderr[-2000:])
    shipped = subprocess.run([str(python), "-c", "from kvdiag.scenario.loader import shipped_scenarios as s; "
                              "print(sorted(map(str, s().values())))"], capture_output=True, text=True, timeout=60,
                             cwd=elsewhere, env=env)
    assert "two-engine-vllm-cpu" in shipped.stdout and str(ROOT) not in shipped.stdout, shipped.stdout
    # The wheel's kvdiag_agent.pth arms the in-process agent at interpreter start, only with KVDIAG_AGENT=1.
    probe = ("import sys, os; print('kvdiag.agent.arm' in sys.modules, "
             "os.path.exists(sys.argv[1] + '/%d.armed' % os.getpid()))")
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir(mode=0o700)
    for value, expect in (("1", "True True"), ("", "False False")):
        got = subprocess.run([str(python), "-c", probe, str(agent_dir)], capture_output=True, text=True, timeout=60,
                             cwd=tmp_path, env={**env, "KVDIAG_AGENT": value, "KVDIAG_AGENT_DIR": str(agent_dir)})
        assert got.stdout.strip() == expect, (value, got.stdout, got.stderr)
