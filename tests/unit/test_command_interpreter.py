"""Which Python a `kind: command` engine runs, read from its command line before launch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvdiag.launch.interpreters import command_interpreter, engine_interpreters
from kvdiag.scenario.loader import parse_scenario


def _venv_like(root: Path) -> Path:
    """A venv-shaped bin/ folder: python3 (a link to this interpreter) and scripts with #! lines."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    for name, line in (("serve-direct", f"#!{bin_dir / 'python3'} -u"), ("serve-env", "#!/usr/bin/env python3"),
                       ("serve-env-s", "#!/usr/bin/env -S python3 -u"), ("not-python", "#!/bin/sh")):
        (bin_dir / name).write_text(f"{line}\nprint('hi')\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_argv0_python_and_python_shebangs_are_recognised(tmp_path: Path) -> None:
    bin_dir = _venv_like(tmp_path / "venv")
    py = str(bin_dir / "python3")
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "PYTHONPATH": "lib"}
    got = command_interpreter([py, "-m", "vllm.entrypoints.openai.api_server"], env, "/work")
    assert got is not None and got.python == py and got.extra_path == ("/work", "/work/lib")
    got = command_interpreter(["python3", "/srv/engine/serve.py", "--port", "8000"], env, "/work")
    assert got is not None and got.python == py and got.extra_path == ("/srv/engine", "/work/lib")
    got = command_interpreter([py, "-I", "-m", "x"], env, "/work")   # isolated: no cwd, no PYTHONPATH
    assert got is not None and got.extra_path == ()
    for script in ("serve-direct", "serve-env", "serve-env-s"):
        got = command_interpreter([script, "--port", "1"], env, "/work")
        assert got is not None and got.python == py, script
        assert got.extra_path[0] == str(bin_dir.resolve()), script    # sys.path[0]: the script's folder
    assert command_interpreter(["not-python"], env, "/work") is None
    assert command_interpreter(["sleep", "1000"], env, "/work") is None
    assert command_interpreter(["no-such-program-kvdiag"], env, "/work") is None


def test_scenario_command_engines_are_listed_with_the_vllm_ones(tmp_path: Path) -> None:
    bin_dir = _venv_like(tmp_path / "venv")
    scenario = parse_scenario(f"""
engines:
  - name: api
    kind: command
    command: ["{bin_dir / 'python3'}", -m, http.server, "{{port}}"]
    cwd: {tmp_path}
  - name: script
    kind: command
    start_after: api
    command: [serve-env, --port, "{{port}}"]
    env: {{PATH: "{bin_dir}:/usr/bin:/bin"}}
  - name: shell
    kind: command
    command: [sh, -c, "sleep 1"]
  - name: simulated
""")
    got = {i.name: i for i in engine_interpreters(scenario)}
    assert set(got) == {"api", "script"}
    assert got["api"].python == str(bin_dir / "python3") and got["api"].extra_path == (str(tmp_path),)
    assert got["script"].python == str(bin_dir / "python3")
