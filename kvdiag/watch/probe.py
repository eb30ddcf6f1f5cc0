"""Bounded probes of a live engine: /health, /metrics, and /proc CPU and thread state."""

from __future__ import annotations

import time

import httpx

from kvdiag.model.run import MetricsSnapshot
from kvdiag.osread.stat import read_stat
from kvdiag.osread.tasks import list_tids
from kvdiag.watch.metrics import parse_metrics


def check_health(client: httpx.Client, base_url: str, timeout_s: float = 1.0) -> bool:
    try:
        return client.get(f"{base_url}/health", timeout=timeout_s).status_code == 200
    except (httpx.HTTPError, OSError):
        return False


def probe_completion(client: httpx.Client, base_url: str, model: str | None, max_tokens: int = 4,
                     timeout_s: float = 30.0) -> tuple[bool, str]:
    """One short non-streaming /v1/completions request; (answered, what came back or why not)."""
    body: dict[str, object] = {"prompt": "kvdiag completion probe", "max_tokens": max_tokens, "ignore_eos": True}
    if model:
        body["model"] = model
    start = time.monotonic()
    try:
        resp = client.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
    except (httpx.HTTPError, OSError) as exc:
        return False, f"{type(exc).__name__}: {exc}"[:200]
    took = time.monotonic() - start
    if resp.status_code != 200:
        return False, f"HTTP {resp.status_code} after {took:.2f}s: {resp.text[:160]}"
    try:
        data = resp.json()
        tokens = int(data.get("usage", {}).get("completion_tokens", 0))
        finish = data["choices"][0].get("finish_reason")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return False, f"unexpected answer after {took:.2f}s: {resp.text[:160]}"
    return tokens > 0, f"{tokens} tokens in {took:.2f}s, finish_reason {finish}"


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
    states = [st.state for st in (read_stat(pid, tid) for tid in list_tids(pid)) if st is not None]
    return all(s in ("S", "D") for s in states) if states else None
