"""Bounded probes of a live engine: /health, /metrics, and /proc CPU and thread state."""

from __future__ import annotations

import math
import os
import re

import httpx

from kvdiag.model import MetricsSnapshot
from kvdiag.proc import FUTEX_WCHANS, process_tree, read_stat

__all__ = ["process_tree"]

_METRIC_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_WANTED = {
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
}


def check_health(client: httpx.Client, base_url: str, timeout_s: float = 1.0) -> bool:
    try:
        return client.get(f"{base_url}/health", timeout=timeout_s).status_code == 200
    except (httpx.HTTPError, OSError):
        return False


def parse_metrics(text: str, t: float, engine: str | None = None) -> MetricsSnapshot:
    """Sum the vLLM gauges/counters we watch over all label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        key = _WANTED.get(m.group("name"))
        if key is None:
            continue
        try:
            v = float(m.group("value"))
        except ValueError:
            continue
        if math.isnan(v):
            continue
        values[key] = values.get(key, 0.0) + v
    return MetricsSnapshot(t=t, engine=engine, **values)


def scrape_metrics(client: httpx.Client, base_url: str, t: float, engine: str | None = None,
                   timeout_s: float = 1.0) -> MetricsSnapshot | None:
    try:
        resp = client.get(f"{base_url}/metrics", timeout=timeout_s)
    except (httpx.HTTPError, OSError):
        return None
    if resp.status_code != 200:
        return None
    return parse_metrics(resp.text, t, engine)


def cpu_ticks(pids: list[int]) -> int | None:
    """Sum of utime+stime (clock ticks) over ``pids``; None if none could be read."""
    stats = [st for st in (read_stat(pid) for pid in pids) if st is not None]
    return sum(st.utime + st.stime for st in stats) if stats else None


def threads_blocked(pid: int) -> bool | None:
    """True when every thread of ``pid`` sleeps (S/D); None if unreadable."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    states = [st.state for st in (read_stat(pid, int(t)) for t in tids) if st is not None]
    return all(s in ("S", "D") for s in states) if states else None


def read_wchan(pid: int, tid: int | None = None) -> str | None:
    path = f"/proc/{pid}/task/{tid}/wchan" if tid else f"/proc/{pid}/wchan"
    try:
        with open(path) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def is_futex_wchan(wchan: str | None) -> bool:
    return bool(wchan) and any(w in (wchan or "") for w in FUTEX_WCHANS)
