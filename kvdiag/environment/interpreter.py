"""Package versions and the kvcached build of the Python an engine runs, not of kvdiag's own interpreter.

A real vLLM engine runs in its own virtual environment (vLLM CPU pins its own
torch), so kvdiag's ``importlib.metadata`` says nothing about it. The versions,
and where kvcached would be imported from, are read from the engine's interpreter:

- :func:`query_interpreter` runs that interpreter as ``python -I -c <script>``
  (standard library only: ``importlib.metadata`` and ``find_spec``, nothing heavy
  imported), in its own process group, killed on timeout; results are cached per
  interpreter;
- :func:`site_versions` reads ``*.dist-info/METADATA`` under given site folders
  directly (no child at all), the fallback when the interpreter cannot run;
- :func:`packages_of` adds the fingerprint of the kvcached found there
  (environment/kvcached.py reads its files);
- :func:`interpreter_of_pid` finds a running process's interpreter: the path it
  was started as (argv[0], which keeps a venv's identity; ``/proc/PID/exe`` is the
  venv's base python) when that is the same binary as ``/proc/PID/exe``, plus the
  head of its ``sys.path`` (the script's folder or the working folder, then its
  ``PYTHONPATH``); a process whose argv was rewritten (vLLM's ``VLLM::EngineCore``
  sets its title) or that runs a venv's script through the base python is placed in
  its environment by :func:`environment_of_pid` (its ``VIRTUAL_ENV``, its script's
  venv, the site-packages it has mapped); :func:`pid_packages` prefers a kvcached
  extension the process has already loaded (``/proc/PID/maps``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvdiag.environment.host import PACKAGES
from kvdiag.kvcached.build import build_at, site_kvcached
from kvdiag.model.environment import InterpreterPackages
from kvdiag.osread.child import ChildTimeout, run_bounded
from kvdiag.osread.maps import mapped_files
from kvdiag.osread.process import read_cmdline, read_cwd, read_environ, read_exe

if TYPE_CHECKING:
    from kvdiag.model.environment import InterpreterPackages

QUERY_TIMEOUT_S = 5.0
# Runs in the engine's interpreter: standard library only, any Python >= 3.8.
_SCRIPT = (
    "import sys, json\n"
    "from importlib import metadata\n"
    "sys.path[0:0] = json.loads(sys.argv[1])\n"
    "out = {}\n"
    "for n in json.loads(sys.argv[2]):\n"
    "    try:\n"
    "        out[n] = metadata.version(n)\n"
    "    except Exception:\n"
    "        out[n] = None\n"
    # Where kvcached would be imported from (find_spec of a top-level package runs none of its code)
    # and the git commit pip recorded: the fingerprint reads the files there.
    "kv = {'locations': [], 'commit': None}\n"
    "try:\n"
    "    import importlib.util\n"
    "    spec = importlib.util.find_spec('kvcached')\n"
    "    kv['locations'] = list(spec.submodule_search_locations or []) if spec else []\n"
    "    raw = metadata.distribution('kvcached').read_text('direct_url.json')\n"
    "    kv['commit'] = (json.loads(raw or '{}').get('vcs_info') or {}).get('commit_id')\n"
    "except Exception:\n"
    "    pass\n"
    "print(json.dumps({'python': '%d.%d.%d' % sys.version_info[:3], 'packages': out, 'kvcached': kv}))\n"
)

_Versions = tuple[str | None, dict[str, str | None]]
_Answer = tuple[_Versions, list[str], str | None]
_cache: dict[tuple[str, tuple[str, ...], tuple[str, ...]], _Answer] = {}


class InterpreterQueryError(Exception):
    """The interpreter could not be asked (missing, not executable, timed out, odd output)."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _ask(python: str, extra_path: Sequence[str], names: Sequence[str], timeout_s: float) -> _Answer:
    """One bounded child per interpreter (cached): ((Python version, versions), kvcached folders, its git commit)."""
    key = (python, tuple(extra_path), tuple(names))
    if key in _cache:
        return _cache[key]
    try:
        code, out, err = run_bounded([python, "-I", "-c", _SCRIPT, json.dumps(list(extra_path)),
                                      json.dumps(list(names))], timeout_s)
    except OSError as exc:
        raise InterpreterQueryError(f"cannot run {python}: {exc.strerror or exc}") from None
    except ChildTimeout:
        raise InterpreterQueryError(f"{python} did not answer within {timeout_s:g}s") from None
    try:
        data = json.loads(out.strip().splitlines()[-1])
        version = data.get("python")
        pkgs = {str(k): (str(v) if v else None) for k, v in dict(data["packages"]).items()}
        kv = dict(data.get("kvcached") or {})
        locations = [str(p) for p in kv.get("locations") or []]
        commit = str(kv["commit"]) if kv.get("commit") else None
    except (ValueError, IndexError, KeyError, TypeError, AttributeError):
        raise InterpreterQueryError(f"{python} gave no versions (exit {code}): "
                                    f"{err.strip()[-200:]}") from None
    _cache[key] = ((str(version) if version else None, pkgs), locations, commit)
    return _cache[key]


def query_interpreter(python: str, extra_path: Sequence[str] = (), names: Sequence[str] = PACKAGES,
                      timeout_s: float = QUERY_TIMEOUT_S) -> tuple[str | None, dict[str, str | None]]:
    """(Python version, {distribution: version or None}) as ``python`` sees them; cached per interpreter."""
    return _ask(python, extra_path, names, timeout_s)[0]


def _metadata_version(path: Path) -> tuple[str, str] | None:
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            name = version = None
            for line in fh:
                if not line.strip():
                    break  # end of the header block
                if line.startswith("Name:"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
    except OSError:
        return None
    return (name, version) if name and version else None


def site_versions(site_dirs: Iterable[Path], names: Sequence[str] = PACKAGES) -> dict[str, str | None]:
    """{distribution: version or None} read from dist-info METADATA / egg-info PKG-INFO under ``site_dirs``.

    The first folder that holds a distribution wins (sys.path order)."""
    wanted = {_norm(n): n for n in names}
    out: dict[str, str | None] = dict.fromkeys(names)
    for d in site_dirs:
        try:
            entries = sorted(d.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.suffix == ".dist-info":
                meta = entry / "METADATA"
            elif entry.suffix == ".egg-info":
                meta = entry / "PKG-INFO" if entry.is_dir() else entry
            else:
                continue
            # Cheap pre-filter on the folder name (name-version.dist-info) before reading the file.
            if _norm(entry.name.split("-", 1)[0]) not in wanted:
                continue
            got = _metadata_version(meta)
            if got is None:
                continue
            orig = wanted.get(_norm(got[0]))
            if orig is not None and out[orig] is None:
                out[orig] = got[1]
    return out


def venv_site_dirs(python: str) -> list[Path]:
    """The site-packages folders of the environment ``python`` belongs to (venv layout), for the fallback."""
    prefix = Path(python).parent.parent
    return sorted(prefix.glob("lib/python3*/site-packages")) + sorted(prefix.glob("lib64/python3*/site-packages"))


def resolve_command(cand: str, cwd: str, path_var: str) -> str | None:
    """The file ``cand`` names, as a shell with ``PATH=path_var`` in ``cwd`` would run it; None if none."""
    if "/" in cand:
        p = cand if os.path.isabs(cand) else os.path.join(cwd, cand)
        return p if os.path.isfile(p) else None
    for d in path_var.split(os.pathsep):
        p = os.path.join(d or cwd, cand)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def interpreter_of_pid(pid: int) -> tuple[str, list[str]]:
    """(interpreter path, PYTHONPATH entries) of a running process; OSError when /proc does not say."""
    exe = read_exe(pid)
    if exe is None:
        raise OSError(f"the executable of pid {pid} cannot be read")
    if exe.endswith(" (deleted)"):
        raise OSError(f"the executable of pid {pid} was deleted ({exe})")
    env = read_environ(pid) or {}
    cwd = read_cwd(pid) or "/"
    argv = read_cmdline(pid) or []
    argv0 = argv[0] if argv else ""
    if not re.match(r"(python|pypy)", os.path.basename(exe)):
        raise OSError(f"pid {pid} runs {exe}, not a Python interpreter")
    python = exe
    if argv0:
        cand = resolve_command(argv0, cwd, env.get("PATH", os.defpath))
        try:
            if cand is not None and os.path.samefile(cand, exe):
                python = os.path.abspath(cand)  # the venv's bin/python, not the base it links to
        except OSError:
            pass
    if not _is_env_python(python):
        # argv[0] did not name the environment (a title set over argv, or the base python running a
        # venv's script): the environment the process really imports from.
        python = environment_of_pid(pid, exe, argv, env, cwd) or python
    return python, sys_path_head(argv[1:], cwd, env.get("PYTHONPATH", ""))


_SITE = re.compile(r"^(/.+?)/lib(?:64)?/python\d[\d.]*/(?:site|dist)-packages/")


def _is_env_python(python: str) -> bool:
    """``python`` is a virtual environment's (its prefix has pyvenv.cfg)."""
    return (Path(python).parent.parent / "pyvenv.cfg").is_file()


def _env_python(prefix: Path, exe: str) -> str | None:
    """The interpreter of the environment at ``prefix`` that is the binary ``exe`` runs (a venv's
    bin/python links to its base), or None when ``prefix`` is not such an environment."""
    for name in ("python3", "python", os.path.basename(exe)):
        cand = prefix / "bin" / name
        try:
            if cand.is_file() and os.path.samefile(cand, exe):
                return str(cand)
        except OSError:
            continue
    return None


def environment_of_pid(pid: int, exe: str, argv: Sequence[str], env: dict[str, str], cwd: str) -> str | None:
    """The interpreter of the virtual environment (or conda prefix) ``pid`` runs in, from what the
    process says of itself, in order: ``VIRTUAL_ENV``; a venv holding the script it runs (``bin/vllm``);
    the prefix of the site-packages it has mapped (torch's, an extension's). None: none found."""
    candidates: list[Path] = []
    if env.get("VIRTUAL_ENV"):
        candidates.append(Path(env["VIRTUAL_ENV"]))
    for arg in argv[1:3]:
        if arg.startswith("/") or arg.startswith("."):
            script = Path(arg if os.path.isabs(arg) else os.path.join(cwd, arg))
            candidates += [script.parent.parent, script.parent.parent.parent]
    for path in mapped_files(pid):
        m = _SITE.match(path)
        if m:
            candidates.append(Path(m.group(1)))
    for prefix in dict.fromkeys(candidates):
        if (prefix / "pyvenv.cfg").is_file() or (prefix / "conda-meta").is_dir():
            found = _env_python(prefix, exe)
            if found is not None:
                return found
    return None


def sys_path_head(args: Sequence[str], cwd: str, pythonpath: str) -> list[str]:
    """The folders ``python ARGS`` puts before its site-packages: ``sys.path[0]``, then ``PYTHONPATH``
    (left out under ``-E``/``-I``)."""
    first = _path0(args, cwd)
    options = [a for a in args[:3] if a.startswith("-") and not a.startswith("--")]
    ignored = any("E" in o[1:] or "I" in o[1:] for o in options if o[1:2] not in ("m", "c", "W", "X"))
    extra = [] if ignored else [p for p in pythonpath.split(os.pathsep) if p]
    return ([first] if first else []) + [p if os.path.isabs(p) else os.path.join(cwd, p) for p in extra]


def _path0(args: Sequence[str], cwd: str) -> str | None:
    """``sys.path[0]`` of ``python ARGS``: the script's folder, the working folder for ``-m``/``-c``;
    None under ``-P``/``-I`` (which leave it out)."""
    short: list[str] = []   # the single-dash options before the script or -m/-c
    takes_value = False
    for arg in args:
        if takes_value:
            takes_value = False
            continue
        if arg.startswith("--"):
            continue
        if arg.startswith("-") and len(arg) > 1:
            short.append(arg)
            if arg[1] in "mc":
                break
            takes_value = arg in ("-W", "-X")
            continue
        if any("P" in o or "I" in o for o in short):
            return None
        return os.path.dirname(os.path.realpath(arg if os.path.isabs(arg) else os.path.join(cwd, arg)))
    if short and short[-1][1] in "mc" and not any("P" in o or "I" in o for o in short):
        return cwd
    return None


def packages_of(who: str, python: str, extra_path: Sequence[str] = ()) -> InterpreterPackages:
    """The record of one interpreter: asked by running it, else read from its venv's site-packages.

    It carries the fingerprint of the kvcached build that interpreter imports (not kvdiag's own)."""
    rec = InterpreterPackages(who=who, python=python)
    try:
        (rec.python_version, rec.packages), locations, commit = _ask(python, extra_path, PACKAGES, QUERY_TIMEOUT_S)
        rec.source = "asked the interpreter"
    except InterpreterQueryError as exc:
        dirs = [Path(p) for p in extra_path] + venv_site_dirs(python)
        rec.packages = site_versions(dirs)
        locations, commit = site_kvcached(dirs), None
        rec.source = "read from site-packages"
        rec.note = str(exc)
    rec.kvcached = build_at(locations, rec.packages.get("kvcached"), commit,
                            installed=rec.packages.get("kvcached") is not None)
    return rec


def _mapped_kvcached(pid: int) -> str | None:
    """The kvcached package folder whose extension module the process has loaded (what really runs)."""
    for path in mapped_files(pid):
        m = re.fullmatch(r"(/\S*/kvcached)/[^/\s]+\.so", path)
        if m:
            return m.group(1)
    return None


def pid_packages(pid: int) -> InterpreterPackages:
    """The versions the Python of a running process (``kvdiag capture --pid``) sees, and its kvcached."""
    python, extra = interpreter_of_pid(pid)
    rec = packages_of(f"pid {pid}", python, extra)
    loaded = _mapped_kvcached(pid)
    if loaded is not None and (rec.kvcached is None or rec.kvcached.location != loaded):
        # The process already loaded a kvcached extension: that build runs, whatever the path says now.
        rec.kvcached = build_at([loaded], rec.packages.get("kvcached"), None)
    return rec


EngineInterpreterLike = tuple[str, str] | tuple[str, str, Sequence[str]]


def engines_packages(engines: Sequence[EngineInterpreterLike]) -> list[InterpreterPackages]:
    """One record per distinct interpreter of ``(engine name, interpreter path[, sys.path head])``."""
    by_python: dict[tuple[str, tuple[str, ...]], InterpreterPackages] = {}
    for item in engines:
        name, python = item[0], item[1]
        extra = tuple(item[2]) if len(item) > 2 else ()
        key = (python, extra)
        if key in by_python:
            by_python[key].who += f", {name}"
        else:
            by_python[key] = packages_of(f"engine {name}", python, extra)
        by_python[key].engines.append(name)
    return list(by_python.values())
