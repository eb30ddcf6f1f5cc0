"""vLLM's /metrics: the one table of the names kvdiag follows, its parser, and the reading it gives.

A reading (:class:`ServerMetrics`) is what the watch and the sentinel compare look to look; its
:meth:`~ServerMetrics.snapshot` is what a bundle stores (``MetricsSnapshot``). vLLM renames a metric now and
then (``gpu_cache_usage_perc`` became ``kv_cache_usage_perc``): both names go in the table below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvdiag.model.run import MetricsSnapshot

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


def parse_metrics(text: str, t: float, engine: str | None = None) -> MetricsSnapshot:
    """The bundle's record of one exposition at run time ``t`` (label sets summed)."""
    return parse_server_metrics(text).snapshot(t, engine)


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


__all__ = ["ServerMetrics", "labeled_samples", "metric_samples", "parse_metrics", "parse_server_metrics"]
