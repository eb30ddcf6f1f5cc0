"""Arm the agent in this process: the native dumper's handlers in front of faulthandler's.

Runs once at interpreter start (``kvdiag_agent.pth`` -> :mod:`kvdiag.agent.boot`), and again in a
child after ``fork()`` (the handlers are inherited; the child answers for its own pid). After that,
nothing of kvdiag runs here until a dump is requested: the trigger signal's handler then writes every
thread's Python stack (faulthandler), native frames and GIL state into the private directory
(csrc/agent.cpp), without the GIL and without allocating. At exit the handlers are told to answer
nothing and the armed record is removed.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from kvdiag.agent.protocol import (
    ArmedRecord,
    agent_dir,
    armed_name,
    ensure_private_dir,
    prune_stale,
    starttime_of,
)

NATIVE_ENV = "KVDIAG_AGENT_NATIVE"   # where the dumper is when kvdiag is only on PYTHONPATH (a staged plugin)
_state: dict[str, object] = {}


def load_extension(name: str, path_env: str) -> Any:
    """Extension module ``name``: importable from the package, else loaded from the file ``$path_env`` names
    (kvdiag only on PYTHONPATH, as in a staged vLLM plugin, has no built extension beside its sources)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        path = os.environ.get(path_env)
        if not path:
            raise
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {name} from {path}") from None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module


def _load_dumper() -> Any:
    """kvdiag.agent._dumper (only an armed process loads the native part)."""
    return load_extension("kvdiag.agent._dumper", NATIVE_ENV)


def _own_starttime() -> int:
    with open("/proc/self/stat", encoding="ascii") as fh:
        started = starttime_of(fh.read())
    if started is None:
        raise OSError("cannot read /proc/self/stat")
    return started


def _write_armed(directory: Path, trigger: int, thread: int) -> Path:
    pid = os.getpid()
    record = ArmedRecord(pid, _own_starttime(), trigger, thread, ".".join(map(str, sys.version_info[:3])))
    path = directory / armed_name(pid)
    tmp = directory / f"{armed_name(pid)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(record.render())
    os.replace(tmp, path)
    return path


def _forget() -> None:
    _load_dumper().disarm()
    path = _state.get("armed")
    if isinstance(path, Path) and path.name == armed_name(os.getpid()):
        try:
            path.unlink()
        except OSError:
            pass


def _after_fork_in_child() -> None:
    _dumper = _load_dumper()
    _dumper.rearm_child()
    directory, trigger, thread = _state["dir"], _state["trigger"], _state["thread"]
    assert isinstance(directory, Path) and isinstance(trigger, int) and isinstance(thread, int)
    try:
        _state["armed"] = _write_armed(directory, trigger, thread)
    except OSError:
        _dumper.disarm()


def arm() -> Path:
    """Arm the agent (idempotent); returns the armed record's path. Raises OSError / RuntimeError /
    ImportError when it cannot (no private directory, native module missing, no free signal)."""
    if "armed" in _state:
        path = _state["armed"]
        assert isinstance(path, Path)
        return path
    directory = agent_dir()
    problem = ensure_private_dir(directory)
    if problem is not None:
        raise OSError(problem)
    _dumper = _load_dumper()
    placeholder, trigger, thread = _dumper.prepare(str(directory))
    # Ours first, so that faulthandler keeps it as the handler it restores when the interpreter finalizes
    # (it would restore the default action otherwise, and a real-time signal's default ends the process).
    _dumper.install()
    # faulthandler writes the Python stacks (GIL-free, stdlib); our handler, installed again in front of it,
    # calls it with its fd pointed at the dump file, and never lets it chain to anything.
    faulthandler.register(trigger, file=placeholder, all_threads=True, chain=False)
    _dumper.install()
    _state.update(dir=directory, trigger=trigger, thread=thread)
    _state["armed"] = _write_armed(directory, trigger, thread)
    prune_stale(directory)   # records of processes killed with SIGKILL, which never removed their own
    atexit.register(_forget)
    os.register_at_fork(after_in_child=_after_fork_in_child)
    return _state["armed"]  # type: ignore[return-value]


def arm_quietly() -> None:
    """:func:`arm`, saying on stderr (one line) why not instead of raising: the target must start anyway."""
    try:
        arm()
    except Exception as exc:  # noqa: BLE001 - anything here must not stop the target from starting
        print(f"kvdiag agent not armed: {type(exc).__name__}: {exc}", file=sys.stderr)


__all__ = ["arm", "arm_quietly"]
