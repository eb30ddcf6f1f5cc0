"""Real `vllm serve` engines (scenario kind ``vllm``): which vLLM to run and how kvdiag's plugin gets in.

The vLLM environment is a separate virtual environment (vLLM CPU pins its own torch), found from the
engine's ``python:`` (a venv folder or its interpreter), else ``$KVDIAG_VLLM_VENV``, else ``vllm`` on
PATH, else the folder scripts/setup_vllm_cpu.sh creates.

kvdiag is not installed in that environment. When the engine uses kvdiag's allocator (``allocator:
stock|fixed``), :func:`stage_plugin` writes a folder that goes first on the engine's PYTHONPATH with:
- ``kvdiag`` -> a link to this kvdiag package (the plugin imports only kvdiag.vllm_plugin and
  kvdiag.allocator from it), and
- a ``*.dist-info`` whose entry point registers ``kvdiag.vllm_plugin:register`` under vLLM's
  ``vllm.general_plugins`` group, so vLLM itself loads the plugin in each of its processes.
The plugin is inert unless ``KVDIAG_VLLM_ALLOCATOR`` is set, and acts only in the EngineCore (and, with
``KVDIAG_VLLM_HANG_RANK``, in the worker of that rank).
The folder lives in the run's private temp folder and goes with it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path

import kvdiag
from kvdiag.allocator import native_module
from kvdiag.errors import ToolMissing

VENV_ENV = "KVDIAG_VLLM_VENV"
MODEL_ENV = "KVDIAG_VLLM_MODEL"
DEFAULT_VENV = Path("~/.cache/kvdiag/vllm-cpu-venv")
DEFAULT_MODEL = Path("~/.cache/kvdiag/tiny-llama")
ENTRY_POINT_GROUP = "vllm.general_plugins"
_SETUP_HINT = ("install vLLM CPU with scripts/setup_vllm_cpu.sh (its venv: ~/.cache/kvdiag/vllm-cpu-venv), "
               "or point the engine's `python:` / $KVDIAG_VLLM_VENV at a Python environment with vLLM")


_DEFAULTED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}")


def expand(text: str) -> str:
    """``$VAR``, ``${VAR}`` and ``${VAR:-default}`` expanded (other unset variables stay as written), then ``~``."""
    text = _DEFAULTED.sub(lambda m: os.environ.get(m.group(1)) or m.group(2), text)
    return os.path.expanduser(os.path.expandvars(text))


def default_model() -> str:
    """The tiny model scripts/setup_vllm_cpu.sh writes ($KVDIAG_VLLM_MODEL overrides)."""
    return expand(os.environ.get(MODEL_ENV) or str(DEFAULT_MODEL))


def find_vllm(python: str | None) -> str:
    """The `vllm` executable of the engine's Python environment; ToolMissing naming what was tried."""
    tried: list[str] = []
    candidates: list[str] = []
    if python:
        candidates.append(expand(python))
    elif os.environ.get(VENV_ENV):
        candidates.append(expand(os.environ[VENV_ENV]))
    else:
        on_path = shutil.which("vllm")
        if on_path:
            return on_path
        tried.append("`vllm` on PATH")
        candidates.append(expand(str(DEFAULT_VENV)))
    for cand in candidates:
        p = Path(cand)
        exe = p / "bin" / "vllm" if p.is_dir() else p.parent / "vllm"
        if exe.is_file() and os.access(exe, os.X_OK):
            return str(exe)
        tried.append(str(exe))
    raise ToolMissing(f"vLLM not found (tried {', '.join(tried)})", hint=_SETUP_HINT)


def engine_python(python_setting: str | None) -> str | None:
    """The interpreter a `vllm` engine runs (its ``python:`` / $KVDIAG_VLLM_VENV / PATH): the
    ``vllm`` script's ``#!`` line, else the ``python`` beside it; None when vLLM is not found."""
    try:
        script = Path(find_vllm(python_setting))
    except ToolMissing:
        return None
    try:
        with script.open("rb") as fh:
            first = fh.readline(4096).decode(errors="replace")
        if first.startswith("#!"):
            parts = first[2:].split()
            if parts and os.path.isabs(parts[0]) and os.path.basename(parts[0]) != "env":
                return parts[0]
    except OSError:
        pass
    for name in ("python3", "python"):
        cand = script.parent / name
        if cand.is_file():
            return str(cand)
    return None


def _kvdiag_package() -> Path:
    return Path(kvdiag.__file__).resolve().parent


def native_library() -> str | None:
    """Path of the built kvdiag._native extension (editable installs keep it outside the package)."""
    try:
        path = getattr(native_module(), "__file__", None)
    except Exception:  # noqa: BLE001 - reported by the plugin inside the engine instead
        return None
    return str(Path(path).resolve()) if path else None


def agent_library() -> str | None:
    """Path of the built agent dumper (kvdiag.agent._dumper), found without loading it."""
    try:
        spec = importlib.util.find_spec("kvdiag.agent._dumper")
    except (ImportError, ValueError):
        return None
    return str(Path(spec.origin).resolve()) if spec is not None and spec.origin else None


def stage_plugin(folder: Path) -> Path:
    """Write the plugin folder (see the module doc) under ``folder``; returns the PYTHONPATH entry."""
    site = folder / "kvdiag-vllm-plugin"
    site.mkdir(parents=True, exist_ok=True)
    link = site / "kvdiag"
    if not link.exists():
        link.symlink_to(_kvdiag_package(), target_is_directory=True)
    dist = site / "kvdiag_vllm_plugin-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvdiag-vllm-plugin\nVersion: 0.1\n",
                                   encoding="utf-8")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nkvdiag = kvdiag.vllm_plugin:register\n",
                                           encoding="utf-8")
    return site


__all__ = ["DEFAULT_MODEL", "DEFAULT_VENV", "ENTRY_POINT_GROUP", "MODEL_ENV", "VENV_ENV", "agent_library",
           "default_model", "engine_python", "expand", "find_vllm", "native_library", "stage_plugin"]
