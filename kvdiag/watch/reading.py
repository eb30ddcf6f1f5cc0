"""What one look at a running server reads: its /metrics progress, /health, and its local EngineCore.

Pure data and parsing; the sentinel (:mod:`kvdiag.watch.sentinel`) judges a sequence of looks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvdiag.model import MetricsSnapshot
from kvdiag.watch.probe import labeled_samples

# Sample name -> field of ServerMetrics; label sets (engines, finish reasons) are summed.
_FIELDS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:request_success_total": "finished",
    "vllm:num_preemptions_total": "preemptions",
    # One observation per engine step: the iteration counter.
    "vllm:iteration_tokens_total_count": "iterations",
    # The API server's own start (prometheus_client's process collector): changes when it restarts.
    "process_start_time_seconds": "start_time",
}

# The API server's own requests in progress (prometheus-fastapi-instrumentator's gauge, where the server
# turns it on): counted in the API server, so a frozen EngineCore cannot freeze it. The watch's own looks
# (/metrics, /health) are not work.
_IN_PROGRESS = ("http_requests_inprogress", "http_requests_in_progress")
_NOT_WORK = ("/metrics", "/health", "/ping", "/version", "/v1/models", "/load")


@dataclass(frozen=True)
class ServerMetrics:
    """The /metrics values the sentinel follows (None: the server does not export it)."""

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    finished: float | None = None
    preemptions: float | None = None
    iterations: float | None = None
    start_time: float | None = None
    api_in_progress: float | None = None    # requests the API server holds (None: not exported)

    @property
    def in_flight(self) -> int | None:
        """Requests running or waiting in the engine, or held by the API server where it says so (the larger);
        None when the server exports none of these gauges."""
        if self.running is None and self.waiting is None and self.api_in_progress is None:
            return None
        return int(max((self.running or 0) + (self.waiting or 0), self.api_in_progress or 0))

    @property
    def progress(self) -> float | None:
        """A cumulative count that grows whenever the engine gets work done: tokens generated,
        prompt tokens prefilled, requests finished. None when none of them is exported."""
        parts = [v for v in (self.generation_tokens, self.prompt_tokens, self.finished) if v is not None]
        return sum(parts) if parts else None

    def snapshot(self, t: float, engine: str | None) -> MetricsSnapshot:
        """The bundle's record of this reading at run time ``t``."""
        return MetricsSnapshot(t=round(t, 3), engine=engine, kv_cache_usage=self.kv_cache_usage,
                               running=self.running, waiting=self.waiting, preemptions=self.preemptions,
                               generation_tokens=self.generation_tokens, prompt_tokens=self.prompt_tokens)


def parse_server_metrics(text: str) -> ServerMetrics:
    """The followed values of a Prometheus exposition (vLLM's names; a malformed line costs only itself)."""
    values: dict[str, float] = {}
    for name, labels, value in labeled_samples(text):
        if name in _IN_PROGRESS and not math.isnan(value):
            if labels.get("handler", "") not in _NOT_WORK:
                values["api_in_progress"] = values.get("api_in_progress", 0.0) + value
            continue
        key = _FIELDS.get(name)
        if key is None or math.isnan(value):
            continue
        if key == "start_time":
            values[key] = value      # one process: never a sum
        else:
            values[key] = values.get(key, 0.0) + value
    return ServerMetrics(**values)


@dataclass(frozen=True)
class CoreSample:
    """The local EngineCore as /proc shows it at one look (main thread's state and wchan)."""

    pid: int
    state: str              # R, S, D, T (stopped), t (traced), Z ...
    wchan: str | None
    cpu_ticks: int          # utime + stime of the process, clock ticks


@dataclass(frozen=True)
class Look:
    """One look at one server. ``t`` is the injected monotonic clock, ``wall`` Unix time."""

    t: float
    wall: float
    metrics: ServerMetrics | None       # None: /metrics did not answer (``error`` says why)
    error: str | None = None
    health: int | None = None           # /health status code; None: no answer
    server_pid: int | None = None       # the local API server (the port's listener)
    core: CoreSample | None = None      # the local EngineCore


__all__ = ["CoreSample", "Look", "ServerMetrics", "parse_server_metrics"]
