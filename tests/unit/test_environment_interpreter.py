"""Package versions of the engine's own interpreter (a vLLM venv), not kvdiag's.

The fake environments are real folders with real dist-info METADATA written here; the interpreter
query runs a real child Python.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvdiag.environment import add_engine_packages, engine_version
from kvdiag.environment.interpreter import (
    engines_packages,
    packages_of,
    query_interpreter,
    site_versions,
    venv_site_dirs,
)
from kvdiag.model.environment import EnvironmentRecord
from kvdiag.report.envtext import environment_lines, package_summary

FAKE = {"vllm": "0.32.0+cpu", "kvcached": "0.1.6", "torch": "2.9.0+cu128"}


def write_dist(site: Path, name: str, version: str) -> None:
    d = site / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nA long description.\n",
                                encoding="utf-8")


def fake_venv(root: Path) -> Path:
    """A venv-shaped folder (no interpreter): lib/python3.X/site-packages with the fake dist-infos."""
    site = root / "lib" / f"python3.{sys.version_info.minor}" / "site-packages"
    for name, version in FAKE.items():
        write_dist(site, name, version)
    write_dist(site, "unrelated", "1.0")
    (root / "bin").mkdir()
    return site


def test_site_versions_reads_dist_info_metadata(tmp_path: Path) -> None:
    site = fake_venv(tmp_path / "venv")
    got = site_versions([site])
    assert {k: got[k] for k in FAKE} == FAKE
    assert got["sglang"] is None and "unrelated" not in got
    # sys.path order: the first folder holding a distribution wins.
    first = tmp_path / "first"
    write_dist(first, "vllm", "9.9.9")
    assert site_versions([first, site])["vllm"] == "9.9.9"
    assert venv_site_dirs(str(tmp_path / "venv" / "bin" / "python")) == [site]


def test_an_interpreter_that_cannot_run_falls_back_to_its_site_packages(tmp_path: Path) -> None:
    fake_venv(tmp_path / "venv")
    rec = packages_of("engine a", str(tmp_path / "venv" / "bin" / "python"))   # there is no such file
    assert {k: rec.packages[k] for k in FAKE} == FAKE
    assert rec.source == "read from site-packages" and "cannot run" in rec.note


def test_query_runs_the_interpreter_with_extra_path_and_is_cached(tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    write_dist(extra, "vllm", "0.32.0+cpu")
    version, pkgs = query_interpreter(sys.executable, [str(extra)])
    assert version == ".".join(map(str, sys.version_info[:3]))
    assert pkgs["vllm"] == "0.32.0+cpu"
    assert query_interpreter(sys.executable, [str(extra)]) is query_interpreter(sys.executable, [str(extra)])


def test_engines_sharing_an_interpreter_share_a_record_and_reports_say_whose(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    for name, version in FAKE.items():
        write_dist(site, name, version)
    py = str(venv / "bin" / "python")
    recs = engines_packages([("a", py), ("b", py)])
    assert len(recs) == 1 and recs[0].who == "engine a, b"
    assert recs[0].source == "asked the interpreter"
    assert {k: recs[0].packages[k] for k in FAKE} == FAKE

    env = EnvironmentRecord(packages={"vllm": None, "kvcached": None, "torch": None}, packages_python=sys.executable)
    add_engine_packages(env, [("a", py), ("b", py)])
    assert engine_version(env, "vllm") == "0.32.0+cpu"
    assert env.cuda_runtime == "12.8 (torch build)"   # from the engine's torch, not kvdiag's (absent)
    line = package_summary(env)
    assert "vLLM 0.32.0+cpu" in line and "engine a, b" in line and py in line
    text = "\n".join(environment_lines(env))
    assert "packages of engine a, b" in text and "vllm 0.32.0+cpu" in text
    assert f"packages (kvdiag's Python {sys.executable}): vllm —" in text
    # Without engine interpreters, the versions are labelled kvdiag's.
    assert "(kvdiag's Python)" in package_summary(EnvironmentRecord(packages={"vllm": None}))
