"""Which Python interpreter each scenario engine runs.

The environment record reads package versions and the kvcached build from the
engines' own interpreters (a vLLM venv is not kvdiag's interpreter); this says
which interpreter that is, with the folders it puts first on ``sys.path``:

- ``vllm`` engines: the ``vllm`` script's interpreter (launch/vllm.py);
- ``command`` engines, before launch: ``argv[0]`` when it is a Python
  (``python3 -m vllm.entrypoints...``, ``/venv/bin/python serve.py``), or a script
  whose ``#!`` line names one (a venv's ``bin/vllm``, ``#!/usr/bin/env python3``);
- after launch (:meth:`kvdiag.runs.lifecycle.LaunchedRun.note_interpreters`): whatever
  the engine's process turned out to run (``/proc/PID/exe``), for wrappers that
  ``exec`` a Python.

``sim`` engines run kvdiag's own Python and are not listed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from kvdiag.environment.interpreter import resolve_command, sys_path_head
from kvdiag.launch.engines import substitute
from kvdiag.launch.vllm import engine_python
from kvdiag.scenario.models import EngineSpec, Scenario

_PYTHON_NAME = re.compile(r"(?:python|pypy)(?:\d+(?:\.\d+)*)?[a-z]?")


class EngineInterpreter(NamedTuple):
    """The Python one engine runs: engine name, interpreter path, folders first on its ``sys.path``."""

    name: str
    python: str
    extra_path: tuple[str, ...] = ()


def _shebang(path: str) -> list[str]:
    """The ``#!`` line of ``path`` split into words (``env -S`` unwrapped); [] when there is none."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(4096)
    except OSError:
        return []
    if not first.startswith(b"#!"):
        return []
    words = first[2:].decode(errors="replace").split()
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if w != "-S" and "=" not in w]
    return words


def _is_python(path: str) -> bool:
    return bool(_PYTHON_NAME.fullmatch(os.path.basename(path)))


def command_interpreter(argv: list[str], env: dict[str, str], cwd: str) -> EngineInterpreter | None:
    """The Python a command line runs (``argv[0]`` or its ``#!`` line), named ``""``; None when not Python.

    ``env`` is the engine's environment (PATH, PYTHONPATH); ``cwd`` its working folder."""
    if not argv:
        return None
    path_var = env.get("PATH", os.defpath)
    exe = resolve_command(argv[0], cwd, path_var)
    if exe is None:
        return None
    args = argv[1:]
    if not _is_python(exe):
        words = _shebang(exe)
        if not words or not _is_python(words[0]):
            return None
        found = words[0] if os.path.isabs(words[0]) else resolve_command(words[0], cwd, path_var)
        if found is None:
            return None
        exe, args = found, [*words[1:], exe, *args]   # the script runs as `python [opts] SCRIPT ARGS`
    extra = sys_path_head(args, cwd, env.get("PYTHONPATH", ""))
    return EngineInterpreter("", os.path.abspath(exe), tuple(extra))


def engine_interpreter(spec: EngineSpec) -> EngineInterpreter | None:
    """The interpreter ``spec`` runs, when it is known to be Python before launch; None otherwise."""
    if spec.kind == "vllm":
        python = engine_python(spec.python)
        return EngineInterpreter(spec.name, python) if python else None
    if spec.kind == "command":
        env = {**os.environ, **spec.env}
        cwd = spec.cwd or os.getcwd()
        found = command_interpreter([substitute(a, spec, spec.port) for a in spec.command], env,
                                    str(Path(cwd).expanduser()))
        return found._replace(name=spec.name) if found else None
    return None


def engine_interpreters(scenario: Scenario) -> list[EngineInterpreter]:
    """Every engine whose Python is known before launch, in start order."""
    out: list[EngineInterpreter] = []
    for spec in scenario.ordered_engines():
        found = engine_interpreter(spec)
        if found:
            out.append(found)
    return out
