"""The load generator against a real in-process uvicorn SSE server that cuts chunks in nasty places."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import pytest
import uvicorn

from kvdiag.load.loadgen import LoadGenerator
from kvdiag.load.request import LoadConfig
from kvdiag.load.stream import RequestStatus
from kvdiag.ports import free_port
from kvdiag.watch.poller import MetricsPoller
from kvdiag.watch.stall import ServingStall

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

N_TOKENS = 12
METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 21.0
vllm:num_requests_waiting{engine="0",model_name="m"} 11.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.987
vllm:num_preemptions_total{engine="0",model_name="m"} 0.0
vllm:generation_tokens_total{engine="0",model_name="m"} 4242.0
"""


def _event(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _token(i: int, n: int, chat: bool) -> bytes:
    last = i == n - 1
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": f"t{i}"},
                                  "finish_reason": "length" if last else None}
    else:
        choice = {"index": 0, "text": f"t{i} \u20ac", "finish_reason": "length" if last else None}
    return _event({"id": "x", "object": "o", "choices": [choice]})


def _nasty_chunks(body: bytes) -> list[bytes]:
    """Cut so that chunks end in `data: `, inside the JSON, inside a UTF-8 sequence and between the two \\n."""
    out: list[bytes] = []
    i = 0
    sizes = [6, 1, 13, 3, 2, 29, 1, 7]
    k = 0
    while i < len(body):
        n = sizes[k % len(sizes)]
        out.append(body[i:i + n])
        i += n
        k += 1
    return out


class SSEApp:
    """Raw ASGI app; what /v1/completions does depends on the prompt."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.metrics_delay_s = 0.0          # /metrics answers this late (a busy server)
        self.sent_at: list[float] = []      # monotonic time each /v1 request arrived

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if path == "/metrics":
            if self.metrics_delay_s:
                await asyncio.sleep(self.metrics_delay_s)
            await self._plain(send, 200, METRICS.encode())
            return
        if path == "/health":
            await self._plain(send, 200, b"")
            return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        body = json.loads(raw)
        self.bodies.append(body)
        self.sent_at.append(time.monotonic())
        chat = path.endswith("/chat/completions")
        mode = body["messages"][0]["content"] if chat else body["prompt"]
        if mode == "status":
            await self._plain(send, 400, b'{"error":{"message":"bad max_tokens","type":"BadRequestError"}}')
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        n = body["max_tokens"]
        stream = b""
        if chat:
            stream += _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        if mode == "slow":   # one token every 50 ms: a request lasts max_tokens / 20 seconds
            await send({"type": "http.response.body", "body": b"", "more_body": True})
            for i in range(n):
                await asyncio.sleep(0.05)
                await send({"type": "http.response.body", "body": _token(i, n, chat), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        if mode in ("ok", "chat"):
            stream += b"".join(_token(i, n, chat) for i in range(n))
            stream += _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n,
                                                       "total_tokens": n + 3}})
            stream += b"data: [DONE]\n\n"
            for c in _nasty_chunks(stream):
                await send({"type": "http.response.body", "body": c, "more_body": True})
                await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        stream += _token(0, n, chat) + _token(1, n, chat)
        if mode == "errevent":
            stream += _event({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
            stream += b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": stream, "more_body": mode == "hang"})
        if mode == "hang":
            await asyncio.sleep(60)   # cancelled by the client going away or server shutdown
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _plain(self, send: Send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # running in a thread
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, SSEApp]]:
    app = SSEApp()
    port = free_port()
    srv = _Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                 timeout_graceful_shutdown=1))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline and th.is_alive():
        time.sleep(0.02)
    assert srv.started, "test server did not start"
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        srv.should_exit = True
        th.join(timeout=10)


async def _until(cond: Callable[[], bool], bound_s: float = 30.0) -> None:
    """Wait (bounded) until ``cond()``; the bound only stops a broken test from hanging."""
    end = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < end, "condition not reached within the test's bound"
        await asyncio.sleep(0.01)


def test_ok_streams_are_measured(server: tuple[str, SSEApp]) -> None:
    url, app = server

    async def go() -> LoadGenerator:
        lg = LoadGenerator(LoadConfig(base_url=url, model="m", concurrency=4, max_tokens=N_TOKENS, prompt="ok"))
        lg.start()
        await _until(lambda: lg.ok >= 12)
        await lg.stop()
        return lg

    lg = asyncio.run(go())
    oks = [r for r in lg.records if r.status is RequestStatus.OK]
    assert len(oks) >= 12 and lg.failed == 0 and lg.timed_out == 0
    for r in oks:
        assert r.tokens == N_TOKENS and r.usage_tokens == N_TOKENS
        assert r.ttft_s is not None and r.ttft_s >= 0
        assert len(r.itl_s) == N_TOKENS - 1 and all(x >= 0 for x in r.itl_s)
        assert r.finish_reason == "length"
    body = app.bodies[-1]
    assert body["stream"] is True and body["ignore_eos"] is True and body["model"] == "m"
    assert body["max_tokens"] == N_TOKENS and body["stream_options"] == {"include_usage": True}
    s = lg.summary()
    assert s.requests_ok == lg.ok and s.tokens == lg.tokens >= 12 * N_TOKENS
    assert s.ttft.count >= 12 and s.itl.p50_s is not None and s.itl.p99_s is not None
    assert lg.in_flight == 0


def test_chat_role_chunk_is_not_a_token(server: tuple[str, SSEApp]) -> None:
    url, _ = server

    async def go() -> LoadGenerator:
        lg = LoadGenerator(LoadConfig(base_url=url, concurrency=2, max_tokens=5, prompt="chat", chat=True))
        lg.start()
        await _until(lambda: lg.ok >= 2)
        await lg.stop()
        return lg

    lg = asyncio.run(go())
    for r in (r for r in lg.records if r.status is RequestStatus.OK):
        assert r.tokens == 5 and len(r.itl_s) == 4


@pytest.mark.parametrize("prompt,status,text", [
    ("status", RequestStatus.HTTP_ERROR, "HTTP 400: bad max_tokens"),
    ("cut", RequestStatus.ERROR, "stream ended without [DONE]"),
    ("errevent", RequestStatus.ERROR, "engine died"),
])
def test_failures_are_classified(server: tuple[str, SSEApp], prompt: str, status: RequestStatus, text: str) -> None:
    url, _ = server

    async def go() -> LoadGenerator:
        lg = LoadGenerator(LoadConfig(base_url=url, concurrency=2, max_tokens=4, prompt=prompt, retry_delay_s=0.01))
        lg.start()
        await _until(lambda: lg.failed >= 3)
        await lg.stop()
        return lg

    lg = asyncio.run(go())
    failed = [r for r in lg.records if r.status is status]
    assert failed and all(r.error and text in r.error for r in failed)
    assert lg.ok == 0
    # answered requests count as progress: a rejecting server is not a stalled one
    assert lg.progress >= lg.failed


def test_read_timeout_ends_a_silent_request(server: tuple[str, SSEApp]) -> None:
    url, _ = server

    async def go() -> LoadGenerator:
        lg = LoadGenerator(LoadConfig(base_url=url, concurrency=1, max_tokens=4, prompt="hang", read_timeout_s=0.3,
                                      retry_delay_s=0.01))
        lg.start()
        await _until(lambda: lg.timed_out >= 1)
        await lg.stop()
        return lg

    lg = asyncio.run(go())
    r = next(r for r in lg.records if r.status is RequestStatus.TIMED_OUT)
    assert r.tokens == 2 and "timeout" in (r.error or "").lower()


def test_watchdog_fires_on_a_mid_stream_stall_and_stop_cancels(server: tuple[str, SSEApp]) -> None:
    url, _ = server

    async def go() -> tuple[LoadGenerator, ServingStall]:
        lg = LoadGenerator(LoadConfig(base_url=url, concurrency=3, max_tokens=4, prompt="hang"))
        wd = ServingStall(0.3)
        lg.start()
        await _until(lambda: wd.observe(lg.in_flight, lg.progress, lg.last_progress_t))
        await lg.stop(timeout_s=10)
        return lg, wd

    lg, wd = asyncio.run(go())
    assert lg.tokens == 6 and lg.sent == 3
    assert wd.onset is not None and wd.fired_at is not None and wd.fired_at - wd.onset >= 0.3
    assert lg.last_token_t is not None and wd.onset >= lg.last_token_t
    assert lg.in_flight == 0 and lg.cancelled == 3
    assert all(r.status is RequestStatus.CANCELLED and r.tokens == 2 for r in lg.records)
    s = lg.summary()
    assert s.requests_cancelled == 3 and s.ttft.count == 3 and s.itl.count == 3


def test_metrics_poller(server: tuple[str, SSEApp]) -> None:
    url, _ = server

    async def go() -> MetricsPoller:
        p = MetricsPoller(url, "e", t0=time.monotonic())
        await p.poll_async()
        await p.aclose()
        return p

    p = asyncio.run(go())
    assert p.scrapes == 1 and p.failures == 0
    snap = p.latest
    assert snap is not None and snap.engine == "e"
    assert (snap.running, snap.waiting, snap.kv_cache_usage, snap.preemptions, snap.generation_tokens) == (
        21.0, 11.0, 0.987, 0.0, 4242.0)


def test_poller_and_clients_survive_a_closed_port() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def go() -> tuple[LoadGenerator, MetricsPoller]:
        p = MetricsPoller(url, None, t0=time.monotonic(), timeout_s=1.0)
        assert await p.poll_async() is None
        lg = LoadGenerator(LoadConfig(base_url=url, concurrency=2, connect_timeout_s=1.0, retry_delay_s=0.01))
        lg.start()
        await _until(lambda: lg.failed >= 4)
        await lg.stop()
        await p.aclose()
        return lg, p

    lg, p = asyncio.run(go())
    assert p.failures == 1 and p.last_error
    assert lg.ok == 0 and all(r.status is RequestStatus.ERROR for r in lg.records if r.status is not
                              RequestStatus.CANCELLED)
    assert "ConnectError" in (lg.first_error or "")


# ---------------------------------------------------------------- the load phase ends at its duration


def test_load_ends_at_the_duration_and_drains_in_flight(server: tuple[str, SSEApp]) -> None:
    """No request is sent after the stated duration; those in flight finish within the grace."""
    url, app = server
    before = len(app.sent_at)

    async def go() -> tuple[LoadGenerator, object]:
        # 20 tokens at 50 ms: each request lasts ~1 s, so the deadline always cuts some mid-stream.
        lg = LoadGenerator(LoadConfig(base_url=url, concurrency=4, max_tokens=20, prompt="slow"))
        s = await lg.run_for(2.0, drain_grace_s=20.0)
        return lg, s

    lg, s = asyncio.run(go())
    assert lg.load_deadline is not None and lg.started_at is not None
    assert s.duration_s == pytest.approx(2.0)                      # the time loaded is the duration
    arrived = app.sent_at[before:]
    assert arrived and max(arrived) <= lg.load_deadline + 0.05     # nothing sent after it
    assert s.drain_in_flight == 4 and s.drain_cut == 0             # the drain let all four finish
    assert s.drain_s is not None and 0.0 < s.drain_s < 20.0
    assert lg.drain_ended_at is not None and lg.stopped_at is not None
    assert lg.drain_ended_at <= lg.stopped_at
    assert s.requests_ok == s.requests_sent and s.requests_cancelled == 0
    assert s.tokens == 20 * s.requests_ok
    assert s.tokens_per_s == pytest.approx(s.tokens / (s.duration_s + s.drain_s))


def test_drain_is_bounded_by_its_grace(server: tuple[str, SSEApp]) -> None:
    url, _ = server

    async def go() -> tuple[LoadGenerator, object]:
        lg = LoadGenerator(LoadConfig(base_url=url, concurrency=3, max_tokens=4, prompt="hang"))
        t = time.monotonic()
        s = await lg.run_for(0.5, drain_grace_s=0.5)
        return lg, (s, time.monotonic() - t)

    lg, (s, wall) = asyncio.run(go())
    assert s.duration_s == pytest.approx(0.5)
    assert s.drain_in_flight == 3 and s.drain_cut == 3 and s.requests_cancelled == 3
    assert s.drain_s is not None and s.drain_s >= 0.5
    assert s.drain_s < 10 and wall < 30        # bounds only against a hang, not a speed target


# ---------------------------------------------------------------- scrapes on their own timer


def test_scrapes_keep_their_period_while_the_event_loop_is_busy(server: tuple[str, SSEApp]) -> None:
    """A load loop that hogs its thread (CPU-bound parsing) does not delay the scrapes."""
    url, _ = server

    async def go() -> tuple[MetricsPoller, int]:
        p = MetricsPoller(url, "e", t0=time.monotonic(), period_s=0.2)
        p.start()
        await _until(lambda: p.scrapes >= 1)
        before = p.scrapes
        # The event loop never yields until three more scrapes landed (bounded: a poller that runs
        # on the loop would never get there). No wall-clock rate is asserted: the machine may be busy.
        end = time.monotonic() + 60.0
        while p.scrapes < before + 3 and time.monotonic() < end:
            sum(range(1000))
        during = p.scrapes - before
        await p.aclose()
        return p, during

    p, during = asyncio.run(go())
    assert during >= 3, (during, p.scrapes, p.failures, p.last_error)
    assert len(p.snapshots) >= 4 and p.longest_gap_s is not None


def test_a_slow_scrape_is_a_gap_not_a_stall(server: tuple[str, SSEApp]) -> None:
    """/metrics answering late leaves a gap in the snapshots; the soak's stall signal (tokens at the
    client) is untouched and the gap is reported as such."""
    url, app = server

    async def go() -> tuple[MetricsPoller, LoadGenerator, ServingStall, bool]:
        p = MetricsPoller(url, "e", t0=time.monotonic(), period_s=0.2, timeout_s=10.0)
        wd = ServingStall(1.0)
        lg = LoadGenerator(LoadConfig(base_url=url, concurrency=2, max_tokens=20, prompt="slow"))
        p.start()
        await _until(lambda: len(p.snapshots) >= 2)
        app.metrics_delay_s = 2.5           # the next scrape answers after 2.5 s: longer than the window
        lg.start()
        fired = False
        end = time.monotonic() + 3.5
        while time.monotonic() < end:
            fired = fired or wd.observe(lg.in_flight, lg.progress, lg.last_progress_t)
            await asyncio.sleep(0.05)
        app.metrics_delay_s = 0.0
        await lg.stop()
        await p.aclose()
        return p, lg, wd, fired

    p, lg, wd, fired = asyncio.run(go())
    assert not fired and not wd.stalled and lg.tokens > 0
    assert p.longest_gap_s is not None and p.longest_gap_s >= 2.0
    assert p.failures == 0
