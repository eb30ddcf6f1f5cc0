"""Environment stage: what machine a run happened on, recorded once into every bundle.

:func:`collect_environment` gathers OS/kernel, Python, package versions
(vLLM, kvcached, torch, ... from metadata, nothing heavy imported; kvdiag's own and,
in ``engine_packages``, those of the interpreters the engines run: see interpreter.py), CUDA
driver/runtime and GPUs (optional cuda-python, in a bounded child process),
the kvcached/vLLM variables in effect (redacted), cgroup CPU/memory limits,
ptrace capability with the fix when capture would be refused, the installed
kvcached's build fingerprint, and kvcached's live state (segments, sockets).
Every part is best effort: what cannot be read becomes a line in ``errors``.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from kvdiag import __version__
from kvdiag.environment.host import os_name, package_versions, relevant_env
from kvdiag.environment.interpreter import engines_packages, pid_packages
from kvdiag.environment.ptrace import probe_ptrace
from kvdiag.kvcached.build import installed_kvcached
from kvdiag.kvcached.runtime import collect_runtime
from kvdiag.model.environment import EnvironmentRecord, GpuInfo, InterpreterPackages
from kvdiag.osread.gpu import read_gpus
from kvdiag.osread.host import cgroup_limits, memory_total_mb, usable_cpus
from kvdiag.osread.process import read_environ

__all__ = ["add_engine_packages", "collect_environment", "engine_version"]

T = TypeVar("T")


def _safe(errors: list[str], what: str, fn: Callable[[], T], default: T) -> T:
    try:
        return fn()
    except Exception as exc:  # one unreadable fact must not cost the record (or the run)
        errors.append(f"{what}: {type(exc).__name__}: {exc}")
        return default


def _runtime_of_torch(version: str | None) -> str | None:
    """``2.10.0+cu128`` → ``12.8 (torch build)``: the CUDA runtime torch ships with."""
    m = re.search(r"\+cu(\d+)(\d)$", version or "")
    return f"{m.group(1)}.{m.group(2)} (torch build)" if m else None


def engine_version(rec: EnvironmentRecord, name: str) -> str | None:
    """``name``'s version as the engines see it (their interpreters first), else as kvdiag sees it."""
    for ip in rec.engine_packages:
        if ip.packages.get(name):
            return ip.packages[name]
    return rec.packages.get(name)


def add_engine_packages(rec: EnvironmentRecord,
                        engines: Sequence[tuple[str, str] | tuple[str, str, Sequence[str]]]) -> None:
    """Record the versions (and kvcached build) the engines' interpreters see; ``engines``: (engine name,
    interpreter path[, folders first on its sys.path]). An interpreter already recorded gains the names."""
    none: list[InterpreterPackages] = []
    for new in _safe(rec.errors, "engine packages", lambda: engines_packages(engines), none):
        same = next((ip for ip in rec.engine_packages if ip.python == new.python and ip.packages == new.packages
                     and ip.kvcached == new.kvcached), None)
        if same is None:
            rec.engine_packages.append(new)
        else:
            same.engines += [n for n in new.engines if n not in same.engines]
            same.who = "engine " + ", ".join(same.engines)
    if rec.cuda_runtime is None or rec.cuda_runtime.endswith("(torch build)"):
        rec.cuda_runtime = _runtime_of_torch(engine_version(rec, "torch")) or rec.cuda_runtime


def collect_environment(environ: Mapping[str, str] | None = None, *, gpus: bool = True,
                        runtime: bool = True, gpu_timeout_s: float = 20.0,
                        target_pid: int | None = None) -> EnvironmentRecord:
    """The environment record of this host. The variables recorded are ``environ``'s, else those of
    ``target_pid`` (a captured engine, when /proc lets us read them), else this process's;
    ``gpus=False`` skips the CUDA query (no child process)."""
    errors: list[str] = []
    source = "kvdiag" if environ is None else "given"
    if environ is None and target_pid is not None:
        environ = read_environ(target_pid)
        if environ is None:
            errors.append(f"environment of pid {target_pid}: not readable; kvdiag's own is shown")
        else:
            source = f"pid {target_pid}"
    env = dict(os.environ if environ is None else environ)
    rec = EnvironmentRecord(os=_safe(errors, "os", os_name, ""), kernel=platform.release(),
                            machine=platform.machine(), python=platform.python_version())
    rec.packages = _safe(errors, "packages", package_versions, {})
    rec.packages["kvdiag"] = __version__
    rec.packages_python = sys.executable
    if target_pid is not None:
        got = _safe(errors, f"packages of pid {target_pid}", lambda: pid_packages(target_pid), None)
        if got is not None:
            rec.engine_packages.append(got)
    rec.env = _safe(errors, "environment", lambda: relevant_env(env), {})
    rec.env_source = source
    rec.cpus = usable_cpus()
    no_limits: tuple[float | None, int | None] = (None, None)
    rec.cpu_limit, rec.memory_limit_mb = _safe(errors, "cgroup", cgroup_limits, no_limits)
    rec.memory_total_mb = memory_total_mb()
    rec.ptrace = _safe(errors, "ptrace", probe_ptrace, rec.ptrace)
    rec.kvcached = _safe(errors, "kvcached", installed_kvcached, rec.kvcached)
    if gpus:
        no_gpu: tuple[str | None, str | None, list[GpuInfo], str] = (None, None, [], "GPU query failed")
        rec.cuda_driver, rec.cuda_runtime, rec.gpus, rec.gpu_note = _safe(
            errors, "gpu", lambda: read_gpus(gpu_timeout_s), no_gpu)
    else:
        rec.gpu_note = "not queried"
    if rec.cuda_runtime is None:
        rec.cuda_runtime = _runtime_of_torch(engine_version(rec, "torch"))
    if runtime:
        rec.kvcached_runtime = _safe(errors, "kvcached runtime", collect_runtime, None)
    rec.errors = errors
    return rec
