"""Host-wide readings: CPU time of all CPUs, memory, usable CPUs, this process's cgroup limits, Yama's scope."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvdiag.osread.files import PROC, read_text

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies over all CPUs from /proc/stat; None where unreadable."""
    text = read_text(f"{PROC}/stat")
    first = text.split("\n", 1)[0].split() if text else []
    if not first or first[0] != "cpu":
        return None
    vals = [int(v) for v in first[1:9]]       # user nice system idle iowait irq softirq steal
    total = sum(vals)
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return total - idle, total


def memory_total_mb() -> int | None:
    """MemTotal of /proc/meminfo in MB."""
    m = re.search(r"^MemTotal:\s+(\d+) kB", read_text(f"{PROC}/meminfo") or "", re.M)
    return int(m.group(1)) // 1024 if m else None


def usable_cpus() -> int | None:
    """CPUs this process may run on (its affinity mask), else the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def yama_ptrace_scope(proc_root: Path = Path(PROC)) -> int | None:
    """kernel.yama.ptrace_scope; None without Yama."""
    try:
        return int((read_text(proc_root / "sys/kernel/yama/ptrace_scope") or "").strip())
    except ValueError:
        return None


def _cgroup_dir() -> Path | None:
    """This process's cgroup v2 folder, or None on cgroup v1."""
    for line in (read_text(f"{PROC}/self/cgroup") or "").splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip().lstrip("/")
            for cand in (_CGROUP_ROOT / rel, _CGROUP_ROOT):
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
        while cur is not None and str(cur).startswith(str(_CGROUP_ROOT)):
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
            cur = cur.parent if cur != _CGROUP_ROOT else None
        return cpu, mem
    quota = (_read(_CGROUP_ROOT / "cpu/cpu.cfs_quota_us") or _read(_CGROUP_ROOT / "cpu,cpuacct/cpu.cfs_quota_us"))
    period = (_read(_CGROUP_ROOT / "cpu/cpu.cfs_period_us") or _read(_CGROUP_ROOT / "cpu,cpuacct/cpu.cfs_period_us"))
    try:
        if quota and period and int(quota) > 0:
            cpu = int(quota) / int(period)
    except ValueError:
        pass
    raw = _read(_CGROUP_ROOT / "memory/memory.limit_in_bytes")
    if raw and raw.isdigit() and int(raw) < (1 << 60):
        mem = int(raw) // (1024 * 1024)
    return cpu, mem
