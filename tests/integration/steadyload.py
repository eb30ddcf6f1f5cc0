"""A small steady streaming load on an OpenAI-compatible server (threads, standard SSE), for tests and
benchmarks that need a server that is busy but not saturated: each of ``streams`` threads sends one
streaming completion after another and counts the content events it receives."""

from __future__ import annotations

import json
import threading
import time

import httpx


class SteadyLoad:
    """``streams`` back-to-back streaming completions until :meth:`stop`; stream i asks for ``max_tokens + 9 i``
    tokens, so the streams drift out of step and the server nearly always has a request running (streams of
    one length finish in the same engine step, and the server's gauges then say 0 running between requests)."""

    def __init__(self, url: str, model: str | None, streams: int = 2, max_tokens: int = 32,
                 read_timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.streams = streams
        self.max_tokens = max_tokens
        self.read_timeout_s = read_timeout_s
        self.tokens = 0
        self.requests_ok = 0
        self.errors = 0
        self.last_token_wall: float | None = None
        self.last_token_mono: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clients: list[httpx.Client] = []

    def start(self) -> SteadyLoad:
        for i in range(self.streams):
            client = httpx.Client(trust_env=False, timeout=httpx.Timeout(10.0, read=self.read_timeout_s))
            self._clients.append(client)
            t = threading.Thread(target=self._run, args=(client, self.max_tokens + 9 * i), name=f"steady-load-{i}",
                                 daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _run(self, client: httpx.Client, max_tokens: int) -> None:
        body: dict[str, object] = {"prompt": "steady load", "max_tokens": max_tokens, "stream": True,
                                   "ignore_eos": True, "temperature": 0}
        if self.model:
            body["model"] = self.model
        while not self._stop.is_set():
            try:
                with client.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        with self._lock:
                            self.errors += 1
                        self._stop.wait(0.5)
                        continue
                    for line in resp.iter_lines():
                        if self._stop.is_set():
                            return
                        if not line.startswith("data:") or line.strip() == "data: [DONE]":
                            continue
                        try:
                            json.loads(line[5:])
                        except ValueError:
                            continue
                        with self._lock:
                            self.tokens += 1
                            self.last_token_wall = time.time()
                            self.last_token_mono = time.monotonic()
                with self._lock:
                    self.requests_ok += 1
            except (httpx.HTTPError, OSError):
                with self._lock:
                    self.errors += 1
                self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        for c in self._clients:
            c.close()   # ends a stream parked on a silent server
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> SteadyLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_engine_busy(url: str, timeout_s: float = 20.0) -> bool:
    """Poll /metrics until the engine reports a request running or waiting (the gauges the EngineCore last
    published; a tiny model's engine is idle between requests much of the time, waiting for the API server)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                text = client.get(f"{url.rstrip('/')}/metrics").text
            except (httpx.HTTPError, OSError):
                text = ""
            busy = 0.0
            for line in text.splitlines():
                if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
                    busy += float(line.rsplit(" ", 1)[1])
            if busy > 0:
                return True
            time.sleep(0.02)
    return False


def served_model(url: str) -> str | None:
    """The first model id the server lists (None when it does not answer)."""
    try:
        data = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=5, trust_env=False).json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError):
        return None
