"""Prometheus text for /metrics with vLLM's metric names, help texts, labels and buckets.

Gauges and engine counters come from the last stats EngineCore sent (so they go stale, as in
vLLM, when EngineCore hangs); request histograms are observed in the API server from the
timestamps EngineCore puts on its outputs. Hand-rolled rather than prometheus_client: one
observe() per streamed token must stay a few hundred nanoseconds.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0)
_PREEMPT_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# vLLM's per-request histograms, in the order its /metrics lists them: (key, name, help text, buckets).
_REQUEST_HISTOGRAMS: tuple[tuple[str, str, str, Sequence[float]], ...] = (
    ("prompt_tokens", "vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKEN_BUCKETS),
    ("generation_tokens", "vllm:request_generation_tokens", "Number of generation tokens processed.",
     _TOKEN_BUCKETS),
    ("max_generation", "vllm:request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", _TOKEN_BUCKETS),
    ("max_tokens", "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
     _TOKEN_BUCKETS),
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS),
    ("tpot", "vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _LATENCY_BUCKETS),
    ("queue", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     _LATENCY_BUCKETS),
    ("inference", "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
     _LATENCY_BUCKETS),
    ("prefill", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
     _LATENCY_BUCKETS),
    ("decode", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
     _LATENCY_BUCKETS),
    ("preemptions", "vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.",
     _PREEMPT_BUCKETS),
)


@dataclass
class Histogram:
    """Cumulative-on-render histogram with Prometheus ``le`` semantics."""

    name: str
    help: str
    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def render(self, labels: str, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {self.help}")
        out.append(f"# TYPE {self.name} histogram")
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append(f'{self.name}_bucket{{{labels},le="{bound!r}"}} {float(running)!r}')
        running += self.counts[-1]
        out.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {float(running)!r}')
        out.append(f"{self.name}_count{{{labels}}} {float(self.n)!r}")
        out.append(f"{self.name}_sum{{{labels}}} {float(self.total)!r}")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class MetricsRegistry:
    """All metrics the API server exposes for one engine."""

    def __init__(self, model_name: str, cache_info: dict[str, str] | None = None) -> None:
        self.labels = f'engine="0",model_name="{_escape(model_name)}"'
        self.cache_info = dict(cache_info or {})
        self.started = time.time()
        # Keyed by what the API server observes; rendered in the table's order.
        self.request_histograms = {key: Histogram(name, help_text, bounds)
                                   for key, name, help_text, bounds in _REQUEST_HISTOGRAMS}
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.stats: dict[str, float] = {}
        self.stats_time: float | None = None   # monotonic time the stats were produced by EngineCore

    def update_stats(self, stats: dict[str, float], produced_at: float) -> None:
        self.stats = stats
        self.stats_time = produced_at

    def render(self) -> str:
        """The whole exposition text."""
        s = self.stats
        lb = self.labels
        out: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for label_str, value in samples:
                out.append(f"{name}{{{label_str}}} {float(value)!r}")

        running = s.get("running", 0.0)
        waiting = s.get("waiting", 0.0)
        family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               [(lb, running)])
        family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               [(lb, waiting)])
        family("vllm:num_requests_waiting_by_reason", "gauge",
               "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
               "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
               "status). Sum of all reasons equals vllm:num_requests_waiting.",
               [(f'{lb},reason="capacity"', waiting), (f'{lb},reason="deferred"', 0.0)])
        family("vllm:engine_sleep_state", "gauge",
               "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
               "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
               [(f'{lb},sleep_state="awake"', 1.0), (f'{lb},sleep_state="weights_offloaded"', 0.0),
                (f'{lb},sleep_state="discard_all"', 0.0)])
        family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               [(lb, s.get("kv_usage", 0.0))])
        family("vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.", [(lb, s.get("prompt_tokens", 0.0))])
        family("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
               [(lb, 0.0)])
        family("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
               [(lb, s.get("preemptions", 0.0))])
        family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               [(lb, s.get("prompt_tokens", 0.0))])
        family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               [(lb, s.get("generation_tokens", 0.0))])
        family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
               [(f'{lb},finished_reason="{r}"', float(n)) for r, n in self.success.items()])
        for hist in self.request_histograms.values():
            hist.render(lb, out)
        if self.cache_info:
            info = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted({**self.cache_info, "engine": "0"}.items()))
            family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [(info, 1.0)])
        # Not in vLLM: what the simulated engine's page allocator holds (watchers must not rely on it).
        family("kvdiag_sim_allocator_pages", "gauge",
               "Pages of the simulated engine's page allocator by state (kvdiag sim only).",
               [(f'{lb},state="{k}"', s.get(f"{k}_pages", 0.0))
                for k in ("total", "free", "inuse", "reserved", "inflight")])
        age = time.monotonic() - self.stats_time if self.stats_time is not None else -1.0
        family("kvdiag_sim_engine_stats_age_seconds", "gauge",
               "Seconds since EngineCore last sent stats; -1 before the first (kvdiag sim only).", [(lb, age)])
        out.append("")
        return "\n".join(out)
