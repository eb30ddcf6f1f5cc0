"""A steady trickle of requests to an engine that is up, for scenarios whose hang comes while serving.

:class:`RequestLoop` sends one non-streaming ``/v1/completions`` request after another on its own
thread (one in flight at a time, each bounded by a timeout) and counts what came back. The first
answer is the warm-up (a real engine compiles kernels on its first forward pass); from then on the
caller feeds the counts to :class:`kvdiag.watch.stall.ServingStall`: a request in flight and nothing
answered for a whole window is a stall, CPU use never counts (vLLM's workers spin on their rings).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

PROMPT = "kvdiag serving probe: tell me a long story about caches"


@dataclass
class RequestCounts:
    """What the loop saw so far (read under the loop's lock)."""

    sent: int = 0
    answered: int = 0
    failed: int = 0
    tokens: int = 0
    in_flight: int = 0
    first_answer_t: float | None = None   # monotonic time of the first answer (the warm-up)
    last_answer_t: float | None = None
    last_error: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def progress(self) -> int:
        """A cumulative count that grows with every answer (tokens plus requests answered)."""
        return self.tokens + self.answered


class RequestLoop:
    """One request after another to ``base_url`` until :meth:`stop`; daemon thread, bounded requests."""

    def __init__(self, base_url: str, model: str | None, max_tokens: int = 16, timeout_s: float = 600.0,
                 pause_s: float = 0.2) -> None:
        self.base_url = base_url
        self.model = model
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.pause_s = pause_s
        self._lock = threading.Lock()
        self._counts = RequestCounts()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdiag-request-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Send no further request; one in flight is left to its timeout (or the engine's teardown)."""
        self._stop.set()

    def counts(self) -> RequestCounts:
        with self._lock:
            return RequestCounts(**{k: getattr(self._counts, k) for k in RequestCounts.__dataclass_fields__
                                    if k != "errors"}, errors=list(self._counts.errors))

    def _run(self) -> None:
        body: dict[str, object] = {"prompt": PROMPT, "max_tokens": self.max_tokens, "ignore_eos": True}
        if self.model:
            body["model"] = self.model
        with httpx.Client(trust_env=False) as client:
            while not self._stop.is_set():
                with self._lock:
                    self._counts.sent += 1
                    self._counts.in_flight = 1
                error: str | None = None
                tokens = 0
                try:
                    resp = client.post(f"{self.base_url}/v1/completions", json=body, timeout=self.timeout_s)
                    if resp.status_code == 200:
                        tokens = int(resp.json().get("usage", {}).get("completion_tokens", 0))
                    else:
                        error = f"HTTP {resp.status_code}: {resp.text[:120]}"
                except (httpx.HTTPError, OSError, ValueError, AttributeError) as exc:
                    error = f"{type(exc).__name__}: {exc}"[:200]
                now = time.monotonic()
                with self._lock:
                    self._counts.in_flight = 0
                    if error is None:
                        self._counts.answered += 1
                        self._counts.tokens += tokens
                        self._counts.last_answer_t = now
                        if self._counts.first_answer_t is None:
                            self._counts.first_answer_t = now
                    else:
                        self._counts.failed += 1
                        self._counts.last_error = error
                        if len(self._counts.errors) < 5:
                            self._counts.errors.append(error)
                if error is not None:
                    self._stop.wait(1.0)   # an engine that refuses is not hammered
                else:
                    self._stop.wait(self.pause_s)


__all__ = ["RequestCounts", "RequestLoop"]
