"""What a new user hits first: usage errors exit 2 with a usage line, help reads well, unwritable --out is 2.

Usage errors are click's (typer raises them); kvdiag maps them, not "internal error" exit 1. The
help must show click's classic metavars (no ``<bool>`` after flags, no ``{bundle}``), which is what
the typer/click pins in pyproject.toml buy: the last test checks the installed versions.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kvdiag.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [["repro", "two-engine"], ["soak"], ["ab"], ["capture"], ["analyze"], ["report"], ["banner"], ["doctor"],
            ["repro"], ["sim"], []]


def run(*argv: str) -> tuple[int, str]:
    """kvdiag in-process with a fixed 100-column terminal; returns (exit code, stdout+stderr)."""
    out = io.StringIO()
    env = {"COLUMNS": "100", "TERM": "dumb", "NO_COLOR": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with redirect_stdout(out), redirect_stderr(out):
            code = main(list(argv))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return code, out.getvalue()


@pytest.mark.parametrize(("argv", "says"), [
    (["repro", "two-engine", "--allocator", "foo"], "'foo' is not one of 'stock', 'fixed'"),
    (["soak", "--allocator", "foo"], "'foo' is not one of"),
    (["capture", "--pid", "abc"], "'abc' is not a valid integer"),
    (["capture", "--engine-core-of", "x"], "'x' is not a valid integer"),
    (["--bogus"], "No such option"),
    (["repro", "two-engine", "--bogus"], "No such option"),
    (["nosuch"], "No such command 'nosuch'"),
    (["analyze"], "Missing argument 'BUNDLE'"),
    (["banner"], "Missing argument 'LOGFILE'"),
    (["soak", "--duration"], "requires an argument"),
])
def test_usage_errors_exit_2_with_a_usage_line(argv: list[str], says: str) -> None:
    code, out = run(*argv)
    assert code == 2, out
    assert "Usage: kvdiag" in out and says in out, out
    assert "internal error" not in out and "Traceback" not in out


@pytest.mark.parametrize("group", [[], ["repro"], ["sim"]])
def test_a_bare_command_group_prints_its_help_and_exits_2(group: list[str]) -> None:
    code, out = run(*group)
    assert code == 2
    assert f"Usage: kvdiag {' '.join(group)}".rstrip() in out and "Commands" in out
    assert "internal error" not in out


def test_the_installed_entry_point_exits_2_on_bad_usage() -> None:
    """The console script as a user runs it (a real process), bare and with a bad value."""
    for argv in ([], ["capture", "--pid", "abc"]):
        proc = subprocess.run([sys.executable, "-m", "kvdiag", *argv], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "Usage: kvdiag" in proc.stdout + proc.stderr
        assert "internal error" not in proc.stderr


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "kvdiag")
def test_help_shows_click_metavars_not_type_tags(cmd: list[str]) -> None:
    code, out = run(*cmd, "--help")
    assert code == 0, out
    usage = next(line for line in out.splitlines() if "Usage:" in line)
    assert "{" not in usage and "<" not in usage, usage
    assert not re.search(r"<(bool|int|float|str|path|text)>", out), out
    assert "--help" in out


@pytest.mark.parametrize(("cmd", "words"), [
    (["ab"], ["stock", "fixed", "side by side", "OUT/stock/", "Exit codes"]),
    (["analyze"], ["BUNDLE", "bundle.json", "verdict", "Exit codes"]),
    (["banner"], ["LOGFILE", "standard input", "min_reserved_pages", "Exit codes"]),
    (["capture"], ["--engine-core-of", "--all-descendants", "Exit codes"]),
])
def test_help_describes_the_command_and_its_arguments(cmd: list[str], words: list[str]) -> None:
    code, out = run(*cmd, "--help")
    assert code == 0
    text = " ".join(out.split())  # rich wraps lines
    for word in words:
        assert word in text, (word, out)
    # The first line of the description says what the command does, not only its exit codes.
    description = out.split("Usage:", 1)[1].splitlines()[2].strip()
    assert description and not description.lower().startswith("exit"), description


@pytest.mark.parametrize("argv", [
    ["repro", "two-engine"], ["soak"], ["ab"], ["capture", "--pid", "{sleeper}"],
    ["report", str(ROOT / "tests" / "fixtures" / "bundles" / "gil_cycle")],
])
def test_unwritable_out_exits_2_in_every_command(argv: list[str], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with subprocess.Popen(["sleep", "60"]) as sleeper:
        try:
            code, out = run(*[a.replace("{sleeper}", str(sleeper.pid)) for a in argv], "--out", str(blocker / "out"))
        finally:
            sleeper.kill()
    assert code == 2, out
    assert "kvdiag: error:" in out and str(blocker) in out and "internal error" not in out


def test_report_html_to_an_unwritable_place_exits_2(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out = run("report", str(ROOT / "tests" / "fixtures" / "bundles" / "gil_cycle"),
                    "--html", str(blocker / "r.html"))
    assert code == 2, out


def test_soak_with_an_invalid_scenario_leaves_no_output_folder(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines:\n  - name: a\n    bogus: 1\n")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code, out = run("soak", "--scenario", str(bad))
    finally:
        os.chdir(cwd)
    assert code == 2
    assert "bad.yaml:3" in out and "bogus" in out
    assert "output" not in out and not (tmp_path / "reports").exists(), out


def test_pinned_cli_libraries_are_the_installed_ones() -> None:
    """The help and usage-error behaviour above depends on these pins (see pyproject.toml)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {r.name: r for r in map(Requirement, deps)}
    for name in ("typer", "click"):
        assert name in pins and pins[name].specifier, f"{name} is not pinned in pyproject.toml"
        assert any(s.operator == "<" for s in pins[name].specifier), f"{name} has no upper bound"
        assert pins[name].specifier.contains(version(name)), (name, version(name), str(pins[name].specifier))


def test_every_commands_line_in_the_help_says_what_it_does() -> None:
    """`kvdiag --help` listed redact as "Exit 0 when nothing credential-shaped is left in FOLDER, 10 when
    something is (file:line and kind" with a line break inside: a command's line says what it does."""
    code, text = run("--help")
    assert code == 0
    listed = re.findall(r"^│ (\w+)\s{2,}(\S.*?)\s*│$", text.split("Commands", 1)[1], re.M)
    assert {name for name, _ in listed} >= {"soak", "capture", "redact", "watch", "sweep"}, text
    for name, line in listed:
        assert not line.startswith("Exit"), (name, line)


def test_analyze_of_a_sweep_folder_names_a_run_to_pass(tmp_path: Path) -> None:
    """`kvdiag analyze SWEEP_DIR` said "no bundle.json found; pass a run folder" of a folder kvdiag wrote."""
    from kvdiag.runs.sweep.session import PLAN_FILE
    sweep = tmp_path / "sweep"
    (sweep / "cells" / "c1" / "run-0" / "bundle").mkdir(parents=True)
    (sweep / PLAN_FILE).write_text("{}")
    (sweep / "report.json").write_text("{}")
    code, text = run("analyze", str(sweep))
    assert code == 2, text
    assert "holds one bundle per run" in text and f"kvdiag analyze {sweep / 'cells' / 'c1' / 'run-0'}" in text, text
