"""Host facts: OS, kernel, Python, package versions, the environment in effect, CPU/memory limits.

Package versions come from installed metadata (importlib.metadata): nothing
heavy (torch, vLLM) is imported just to ask its version.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from kvdiag.proc import read_text

# The distributions a kvcached/vLLM bug report needs, by their PyPI names.
PACKAGES = ("vllm", "kvcached", "torch", "cuda-python", "flashinfer-python", "sglang", "pystack", "py-spy")
# Variables that change how kvcached or vLLM behave.
ENV_PREFIXES = ("KVCACHED_", "VLLM_", "CUDA_", "NCCL_", "PYTORCH_CUDA_", "TORCH_CUDA_", "HF_")
ENV_NAMES = frozenset({"ENABLE_KVCACHED", "NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD",
                       "PYTHONMALLOC", "OMP_NUM_THREADS"})


def os_name() -> str:
    """PRETTY_NAME from /etc/os-release, else platform's description."""
    try:
        for line in Path("/etc/os-release").read_text(encoding="utf-8").splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform(terse=True)


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version per distribution, None when it is not installed."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
        except Exception:  # a broken dist-info must not stop the record
            out[name] = None
    return out


def relevant_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The kvcached/vLLM/CUDA variables in ``environ``, secrets replaced (sorted by name)."""
    from kvdiag.redact import REDACTED, is_secret_name, redact_text

    out: dict[str, str] = {}
    for key in sorted(environ):
        if key in ENV_NAMES or key.startswith(ENV_PREFIXES):
            value = environ[key]
            out[key] = REDACTED if (is_secret_name(key) and value) else redact_text(value)[:500]
    return out


def _cgroup_dir() -> Path | None:
    """This process's cgroup v2 folder, or None on cgroup v1."""
    try:
        lines = Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            rel = line[3:].strip().lstrip("/")
            for cand in (Path("/sys/fs/cgroup") / rel, Path("/sys/fs/cgroup")):
                if (cand / "cgroup.controllers").exists():
                    return cand
    return None


def _read(path: Path) -> str | None:
    text = read_text(path)
    return None if text is None else text.strip()


def cgroup_limits() -> tuple[float | None, int | None]:
    """(CPU quota in CPUs, memory limit in MB) from cgroup v2 or v1; None where unlimited or unknown."""
    cpu: float | None = None
    mem: int | None = None
    d = _cgroup_dir()
    if d is not None:
        # Limits may sit on an ancestor: walk up and keep the tightest.
        cur: Path | None = d
        while cur is not None and str(cur).startswith("/sys/fs/cgroup"):
            raw = _read(cur / "cpu.max")
            if raw and not raw.startswith("max"):
                parts = raw.split()
                try:
                    c = int(parts[0]) / int(parts[1])
                    cpu = c if cpu is None else min(cpu, c)
                except (ValueError, IndexError, ZeroDivisionError):
                    pass
            raw = _read(cur / "memory.max")
            if raw and raw != "max" and raw.isdigit():
                m = int(raw) // (1024 * 1024)
                mem = m if mem is None else min(mem, m)
            cur = cur.parent if cur != Path("/sys/fs/cgroup") else None
        return cpu, mem
    quota = (_read(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"))
             or _read(Path("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us")))
    period = (_read(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
              or _read(Path("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us")))
    try:
        if quota and period and int(quota) > 0:
            cpu = int(quota) / int(period)
    except ValueError:
        pass
    raw = _read(Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
    if raw and raw.isdigit() and int(raw) < (1 << 60):
        mem = int(raw) // (1024 * 1024)
    return cpu, mem


def memory_total_mb() -> int | None:
    try:
        text = Path("/proc/meminfo").read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(r"^MemTotal:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) // 1024 if m else None


def usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def process_environ(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with (/proc/PID/environ), or None when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out
