"""Bounded probes of a live engine: /health, /metrics, and /proc CPU and thread state."""

from __future__ import annotations

import math
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvdiag.model import MetricsSnapshot
from kvdiag.osread.stat import read_stat
from kvdiag.osread.tasks import list_tids

__all__ = ["labeled_samples", "metric_samples"]

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


def parse_metrics(text: str, t: float, engine: str | None = None) -> MetricsSnapshot:
    """Sum the vLLM gauges/counters we watch over all label sets (prometheus_client's parser)."""
    values: dict[str, float] = {}
    for name, value in metric_samples(text):
        key = _WANTED.get(name)
        if key is not None and not math.isnan(value):
            values[key] = values.get(key, 0.0) + value
    return MetricsSnapshot(t=t, engine=engine, **values)


def metric_samples(text: str) -> list[tuple[str, float]]:
    """(sample name, value) of every sample in an exposition; a malformed line costs only itself."""
    return [(name, value) for name, _labels, value in labeled_samples(text)]


def labeled_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample in an exposition; a malformed line costs only itself."""
    try:
        return [(s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(text)
                for s in fam.samples]
    except ValueError:
        out: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            try:
                out += [(s.name, dict(s.labels), float(s.value))
                        for fam in text_string_to_metric_families(line + "\n") for s in fam.samples]
            except ValueError:
                continue
        return out


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
