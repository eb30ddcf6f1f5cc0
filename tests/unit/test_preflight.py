"""What a run can check before launching: a vLLM model folder that does not exist, a venv with no `vllm`
(exit 2, file:line, the field and the path), and a crash summary that names the exception, not the header."""

from __future__ import annotations

import io
import os
import stat
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from kvdiag.analyze.engine_rules import engine_verdict
from kvdiag.cli.main import main
from kvdiag.errors import ScenarioError
from kvdiag.launch.preflight import check_launchable
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import EnginePhase, VerdictKind
from kvdiag.model.run import EngineRecord
from kvdiag.scenario.loader import parse_scenario


def _venv_with_vllm(root: Path) -> Path:
    exe = root / "venv" / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return root / "venv"


def _scenario(model: str, python: Path) -> str:
    return f"""windows:
  stall_s: 5
engines:
  - name: e1
    kind: vllm
    python: {python}
    model: {model}
    allocator: external
"""


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_a_missing_model_folder_is_refused_before_launching(tmp_path: Path) -> None:
    venv = _venv_with_vllm(tmp_path)
    f = tmp_path / "s.yaml"
    f.write_text(_scenario(str(tmp_path / "no-such-model"), venv))
    out = tmp_path / "out"
    code, text = _run("repro", "two-engine", "--scenario", str(f), "--out", str(out))
    assert code == 2, text
    assert f"{f}:7: engines[0].model: model folder {tmp_path / 'no-such-model'} does not exist" in " ".join(
        text.split()), text
    assert not out.exists()          # refused before any folder (or engine) existed
    code, text = _run("ab", "--scenario", str(f), "--out", str(out))
    assert code == 2 and "engines[0].model" in text and not out.exists()


def test_a_venv_without_vllm_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "empty-venv" / "bin").mkdir(parents=True)
    (tmp_path / "model").mkdir()
    text = _scenario(str(tmp_path / "model"), tmp_path / "empty-venv")
    with pytest.raises(ScenarioError) as err:
        check_launchable(parse_scenario(text, "s.yaml"), "s.yaml", text)
    assert err.value.line == 6 and err.value.field == "engines[0].python"
    assert str(tmp_path / "empty-venv" / "bin" / "vllm") in str(err.value)


def test_hub_ids_and_existing_folders_pass(tmp_path: Path) -> None:
    venv = _venv_with_vllm(tmp_path)
    for model in ("facebook/opt-125m", str(tmp_path)):
        text = _scenario(model, venv)
        check_launchable(parse_scenario(text, "s.yaml"), "s.yaml", text)
    os.environ.pop("KVDIAG_TEST_UNSET_MODEL", None)
    text = _scenario("${KVDIAG_TEST_UNSET_MODEL:-" + str(tmp_path) + "}", venv)
    check_launchable(parse_scenario(text, "s.yaml"), "s.yaml", text)


def test_a_crash_summary_names_the_exception_line() -> None:
    tail = ["(APIServer pid=9) INFO Starting vLLM API server", "(EngineCore_DP0 pid=12) ERROR Traceback (most recent "
            "call last):", '  File "/venv/lib/python3.12/site-packages/transformers/utils/hub.py", line 470, in '
            "cached_files", "    raise OSError(", "OSError: /models/missing does not appear to have a file named "
            "config.json. Checkout 'https://huggingface.co//models/missing/tree/None' for available files."]
    e = EngineRecord(name="e1", phase=EnginePhase.EXITED, exit_code=1, log_tail=tail, last_log_line=tail[-1],
                     error=tail[1])
    v = engine_verdict("e1", e, [], Bundle(engines=[e]), [])
    assert v.kind is VerdictKind.CRASH
    assert "OSError: /models/missing does not appear to have a file named config.json" in v.summary
    assert "Traceback" not in v.summary
