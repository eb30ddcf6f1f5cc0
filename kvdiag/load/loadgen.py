"""Saturating streaming load: N asyncio clients looping OpenAI streaming requests until stopped.

Each client sends ``/v1/completions`` (or ``/v1/chat/completions``) with ``stream: true``,
``ignore_eos`` and ``max_tokens``, reads the SSE body incrementally, and records per request
the time to first token, the gaps between tokens, the token count and how it ended. Live
counters (requests in flight, tokens, time of the last token) feed the no-progress watchdog.

Timing: TTFT runs from the moment the request is written to the socket to the arrival of the
network chunk that completed the first token event; ITL between the chunks that completed
consecutive token events. Every client first opens its keep-alive connection (``GET /health``) so
connection setup is not counted as server latency. Against a plain http:// server each client
speaks HTTP/1.1 itself (kvdiag.load.rawhttp: about half the client CPU of httpx per token, so the
client takes less from the server it measures); an injected httpx transport (tests, the accuracy
benchmark's tap) or https uses httpx.

A token event is an SSE event that carries a choice with ``text`` (completions) or a content delta
(chat), its text possibly empty: vLLM sends one per generated token, and a byte-level tokenizer's
token often decodes to nothing until its UTF-8 character is complete. That is also what `vllm bench
serve` times (its first token is the first event with a choice). The token count of a finished request
is the server's ``usage.completion_tokens`` when it sends one (one event can carry several tokens when
the server coalesces output under load), else the events counted.

Every wait is bounded: connect, write and pool timeouts, and a read timeout that ends a
request when the server sends no byte for ``read_timeout_s``. :meth:`LoadGenerator.stop`
cancels in-flight requests (they count as cancelled, not failed).

Ending the load: :meth:`LoadGenerator.end_load` marks the end of the loaded time (the stated
duration is over, or a stall was declared); with ``drain=True`` no client sends another request,
the ones in flight may finish (the caller bounds that wait, see :meth:`drained`), and
:meth:`stop` cancels whatever is left. The summary's ``duration_s`` is the loaded time only;
the drain is reported apart (``drain_s``, requests completed and cut by it).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import httpx

from kvdiag.load.rawhttp import RawConnection, RawHTTPError, RawTimeout, ReadDeadlines, plain_http
from kvdiag.load.sse import SSEParser, SSEProtocolError
from kvdiag.load.stats import LatencySummary, SampleReservoir, SoakSummary

# httpcore imports anyio's asyncio backend on the first connection (~25-35 ms on a small box);
# importing it here keeps that out of the first requests' TTFT.
for _mod in ("anyio", "anyio._backends._asyncio", "anyio.streams.tls", "httpcore._backends.anyio"):
    try:
        importlib.import_module(_mod)
    except ImportError:  # pragma: no cover - another layout: the first requests pay for it instead
        pass
# httpcore runs `import sniffio` on every request; without sniffio installed each attempt searches
# sys.path again (~0.2 ms). A None entry makes the failing import instant (same ImportError).
if "sniffio" not in sys.modules and importlib.util.find_spec("sniffio") is None:
    sys.modules["sniffio"] = None  # type: ignore[assignment]

Clock = Callable[[], float]

DEFAULT_PROMPT = ("You are a GPU memory allocator. Describe, step by step and at length, how a KV cache "
                  "page moves between the free list, the reserved list and a running request.")


_JSON = {"content-type": "application/json"}


class RequestStatus(str, Enum):
    OK = "ok"                  # 200, stream ended with [DONE]
    HTTP_ERROR = "http_error"  # non-200 status
    TIMED_OUT = "timed_out"    # connect/read/write/pool timeout
    ERROR = "error"            # connection refused/reset, stream cut, malformed SSE, error event
    CANCELLED = "cancelled"    # stopped by the soak (duration over, stall captured, Ctrl-C)


@dataclass(frozen=True)
class LoadConfig:
    """What the clients send and how long they wait."""

    base_url: str
    model: str | None = None
    concurrency: int = 32
    max_tokens: int = 256
    prompt: str | list[int] = DEFAULT_PROMPT   # text, or token ids (completions only): a prompt of exact length
    chat: bool = False
    ignore_eos: bool = True
    include_usage: bool = True
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0     # no byte at all for this long ends the request as timed out
    write_timeout_s: float = 10.0
    retry_delay_s: float = 0.2       # pause after a failed request, so a refusing server is not hammered
    warmup: bool = True              # open every connection (GET /health) before the first timed request
    keep_records: int = 10_000       # most recent per-request records kept for inspection
    max_requests: int | None = None  # stop sending after this many (None: until stopped)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.chat and not isinstance(self.prompt, str):
            raise ValueError("a chat prompt must be text")
        for name in ("connect_timeout_s", "read_timeout_s", "write_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "stream": True}
        if self.model:
            body["model"] = self.model
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension: always generate max_tokens
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass
class RequestRecord:
    """One request as the client saw it. Times come from the generator's clock."""

    start: float                          # when the request was written to the socket (TTFT starts here)
    status: RequestStatus = RequestStatus.CANCELLED
    issued: float | None = None           # when the client began the request (before the write)
    end: float | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0                       # token events received
    usage_tokens: int | None = None       # completion_tokens from the usage chunk, when sent
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None


class StreamReader:
    """Turns the SSE events of one OpenAI streaming response into token timings."""

    def __init__(self, record: RequestRecord, on_token: Callable[[float], None]) -> None:
        self.record = record
        self.on_token = on_token
        self.parser = SSEParser()
        self.done = False
        self._last_t: float | None = None

    def feed(self, chunk: bytes, now: float) -> None:
        """Parse one network chunk received at ``now``; every token event in it gets that time."""
        for ev in self.parser.feed(chunk):
            if self.done:
                continue
            if ev.is_done:
                self.done = True
                continue
            self._event(ev.data, now)

    def close(self) -> None:
        """The body ended: the request is OK when ``[DONE]`` came, else an error saying it did not."""
        self.parser.close()
        if self.done:
            self.record.status = RequestStatus.OK
        else:
            self.record.status = RequestStatus.ERROR
            self.record.error = "stream ended without [DONE]"

    def _event(self, data: str, now: float) -> None:
        rec = self.record
        try:
            obj = json.loads(data)
        except json.JSONDecodeError as exc:
            raise SSEProtocolError(f"malformed SSE data ({exc.msg} at {exc.pos}): {data[:80]!r}") from None
        if not isinstance(obj, dict):
            raise SSEProtocolError(f"SSE data is not a JSON object: {data[:80]!r}")
        err = obj.get("error")
        if err is not None:
            msg = err.get("message") if isinstance(err, dict) else err
            raise _ServerStreamError(str(msg)[:300])
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            rec.usage_tokens = usage["completion_tokens"]
        choices = obj.get("choices")
        if not choices or not isinstance(choices, list):
            return
        choice = choices[0]
        if not isinstance(choice, dict):
            return
        if choice.get("finish_reason"):
            rec.finish_reason = str(choice["finish_reason"])
        if "text" in choice:
            is_token = True
        else:
            delta = choice.get("delta")
            # Chat: the first delta only announces the role; it carries no generated token.
            is_token = isinstance(delta, dict) and bool(
                delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                or ("content" in delta and "role" not in delta))
        if not is_token:
            return
        if self._last_t is None:
            rec.ttft_s = now - rec.start
        else:
            rec.itl_s.append(now - self._last_t)
        self._last_t = now
        rec.tokens += 1
        self.on_token(now)


class _SendStamp:
    """httpcore ``trace`` hook: moves the request's start to the moment its bytes go out.

    Between ``client.stream()`` and the socket write the request waits for this event loop (other
    streams' chunks, httpx's own work): up to tens of ms on a busy 2-core box. That wait is the
    client's, not the server's, so TTFT starts when the request headers are sent.
    """

    __slots__ = ("rec", "clock", "done")

    def __init__(self, rec: RequestRecord, clock: Clock) -> None:
        self.rec = rec
        self.clock = clock
        self.done = False

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if not self.done and event == "http11.send_request_headers.started":
            self.done = True
            self.rec.start = self.clock()


class _ServerStreamError(Exception):
    """The server sent an error object inside the stream."""


class LoadGenerator:
    """N concurrent streaming clients. Use :meth:`start`, then :meth:`stop` (or :meth:`run_for`)."""

    def __init__(self, cfg: LoadConfig, clock: Clock = time.monotonic,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._raw = transport is None and plain_http(cfg.base_url)
        self._deadlines: ReadDeadlines | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        self._drain_event: asyncio.Event | None = None
        self._warm_left = 0
        self._warm_done: asyncio.Event | None = None
        self._body = b""
        self._request = b""
        self.started_at: float | None = None
        self.duration_s: float | None = None
        self.load_deadline: float | None = None    # started_at + duration_s once warmed up
        self.load_ended_at: float | None = None    # end of the loaded time (duration over, stall, stop)
        self.drain_started_at: float | None = None  # no new request after this
        self.drain_in_flight = 0                   # requests in flight when the drain began
        self.drain_cut = 0                         # of those, still in flight when stop() cancelled them
        self.drain_ended_at: float | None = None   # the last one finished, or stop() cancelled the rest
        self.stopped_at: float | None = None
        # live counters (read by the watchdog and the progress view)
        self.in_flight = 0
        self.sent = 0
        self.ok = 0
        self.failed = 0
        self.timed_out = 0
        self.cancelled = 0
        self.http_errors = 0
        self.tokens = 0
        # Tokens the server counted (usage.completion_tokens) beyond the token events received: a server
        # that coalesces several tokens into one SSE event under load sends fewer events than tokens.
        self.usage_extra_tokens = 0
        self.last_token_t: float | None = None
        # Progress for the watchdog: tokens plus requests the server answered (ok or an error
        # response), so a server that rejects requests fast is never mistaken for a stall.
        self.progress = 0
        self.last_progress_t: float | None = None
        self.first_error: str | None = None
        self.last_error: str | None = None
        self.ttft = SampleReservoir()
        self.itl = SampleReservoir(seed=1)
        self.records: deque[RequestRecord] = deque(maxlen=max(1, cfg.keep_records))

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, duration_s: float | None = None) -> None:
        """Start the clients on the running event loop.

        With ``duration_s`` the load ends by itself that long after the warm-up: from then on no
        client sends a new request (a drain begins, see :meth:`end_load`), however late the
        caller's own loop notices."""
        if self._tasks:
            raise RuntimeError("load generator already started")
        cfg = self.cfg
        limits = httpx.Limits(max_connections=cfg.concurrency + 2, max_keepalive_connections=cfg.concurrency + 2)
        timeout = httpx.Timeout(connect=cfg.connect_timeout_s, read=cfg.read_timeout_s,
                                write=cfg.write_timeout_s, pool=cfg.connect_timeout_s + cfg.read_timeout_s)
        self._client = httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=timeout, trust_env=False,
                                         transport=self._transport)
        if self._raw:
            self._deadlines = ReadDeadlines(cfg.read_timeout_s, self.clock)
            self._deadlines.start()
        # One encoded body for every request: building it per request is CPU taken from timing.
        self._body = json.dumps(cfg.body(), separators=(",", ":")).encode()
        self._request = RawConnection(cfg.base_url, cfg.connect_timeout_s).request_bytes(
            "POST", cfg.endpoint, self._body)
        self._stop_event = asyncio.Event()
        self._drain_event = asyncio.Event()
        self._warm_done = asyncio.Event()
        self._warm_left = cfg.concurrency
        self.duration_s = duration_s
        self.started_at = self.clock()
        if not cfg.warmup:
            self._warm_done.set()
            self._set_deadline()
        self._tasks = [asyncio.create_task(self._client_loop(), name=f"kvdiag-soak-client-{i}")
                       for i in range(cfg.concurrency)]

    def _set_deadline(self) -> None:
        if self.duration_s is not None and self.started_at is not None:
            self.load_deadline = self.started_at + self.duration_s

    def past_deadline(self) -> bool:
        """True once the stated duration is over (it then ends the load, with a drain)."""
        if self.load_deadline is None or self.clock() < self.load_deadline:
            return False
        self.end_load(drain=True, at=self.load_deadline)
        return True

    def end_load(self, drain: bool = False, at: float | None = None) -> None:
        """The loaded time ends now (or at ``at``); with ``drain`` no client sends another request.

        Requests in flight keep going: the caller waits for :meth:`drained` within its grace (or
        keeps them in flight for a capture), then calls :meth:`stop`."""
        now = self.clock()
        if self.load_ended_at is None:
            self.load_ended_at = now if at is None else at
        if drain and self.drain_started_at is None:
            self.drain_started_at = now if at is None else min(at, now)
            self.drain_in_flight = self.in_flight
            if self.in_flight <= 0:
                self.drain_ended_at = self.drain_started_at
            if self._drain_event is not None:
                self._drain_event.set()

    def drained(self) -> bool:
        """True once a drain has begun and no request is in flight any more."""
        return self.drain_started_at is not None and self.in_flight <= 0

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop sending, cancel in-flight requests and close the connections (bounded)."""
        if self._stopping:
            return
        self._stopping = True
        if self.stopped_at is None:
            self.stopped_at = self.clock()
        self.end_load()
        if self.drain_started_at is not None and self.drain_ended_at is None:
            self.drain_ended_at = self.stopped_at
            self.drain_cut = self.in_flight
        if self._drain_event is not None:
            self._drain_event.set()
        if self._stop_event is not None:
            self._stop_event.set()
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        if self._deadlines is not None:
            await self._deadlines.stop()
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.aclose(), timeout=timeout_s)
            except (asyncio.TimeoutError, httpx.HTTPError, OSError):
                pass

    async def run_for(self, duration_s: float, drain_grace_s: float = 0.0) -> SoakSummary:
        """Start, load for ``duration_s`` seconds (from the end of the warm-up), let requests in
        flight finish for up to ``drain_grace_s``, stop; returns the summary."""
        self.start(duration_s)
        try:
            while not self.past_deadline():
                left = self.load_deadline - self.clock() if self.load_deadline is not None else 0.25
                await asyncio.sleep(min(max(left, 0.0), 0.25))
            until = (self.drain_started_at or self.clock()) + drain_grace_s
            while not self.drained() and self.clock() < until:
                await asyncio.sleep(min(0.05, max(0.0, until - self.clock())))
        finally:
            await self.stop()
        return self.summary()

    @property
    def warmed_up(self) -> bool:
        """True once every client opened its connection: :attr:`started_at` is the load's start."""
        return self._warm_done is not None and self._warm_done.is_set()

    @property
    def stopping(self) -> bool:
        return self._stopping

    # -- one client --------------------------------------------------------------------------------
    async def _warm_up(self, conn: RawConnection | None) -> None:
        """Open this client's keep-alive connection, then wait for the others (all bounded by timeouts).

        Connection setup and the HTTP stack's first-use costs then stay out of the first requests'
        TTFT, which measures the server, not the client's start-up burst."""
        client, done = self._client, self._warm_done
        assert client is not None and done is not None
        if conn is not None:
            try:
                status, body = await conn.exchange(conn.request_bytes("GET", "/health"))
                async for _ in body:
                    pass
            except (RawHTTPError, RawTimeout):
                pass  # no /health (or no server): the timed requests will say what is wrong
        else:
            try:
                await client.get("/health", timeout=self.cfg.connect_timeout_s)
            except (httpx.HTTPError, OSError):
                pass
        self._warm_left -= 1
        if self._warm_left <= 0:
            self.started_at = self.clock()
            self._set_deadline()
            done.set()
        await done.wait()

    async def _client_loop(self) -> None:
        stop = self._stop_event
        assert stop is not None
        conn: RawConnection | None = None
        if self._raw:
            conn = RawConnection(self.cfg.base_url, self.cfg.connect_timeout_s, self.clock)
            assert self._deadlines is not None
            self._deadlines.connections.append(conn)
        if self._warm_done is not None and not self._warm_done.is_set():
            await self._warm_up(conn)
        drain = self._drain_event
        assert drain is not None
        limit = self.cfg.max_requests
        while not stop.is_set() and not drain.is_set() and (limit is None or self.sent < limit):
            if self.past_deadline():
                break
            rec = await (self._one_raw_request(conn) if conn is not None else self._one_request())
            if rec.status not in (RequestStatus.OK, RequestStatus.CANCELLED) and self.cfg.retry_delay_s > 0:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=self.cfg.retry_delay_s)
                except asyncio.TimeoutError:
                    pass

    def _token(self, now: float) -> None:
        self.tokens += 1
        self.last_token_t = now
        self.progress += 1
        self.last_progress_t = now

    async def _one_request(self) -> RequestRecord:
        client = self._client
        assert client is not None
        now = self.clock()
        rec = RequestRecord(start=now, issued=now)
        self.sent += 1
        self.in_flight += 1
        reader = StreamReader(rec, self._token)
        try:
            stamp = _SendStamp(rec, self.clock)
            async with client.stream("POST", self.cfg.endpoint, content=self._body, headers=_JSON,
                                     extensions={"trace": stamp}) as resp:
                rec.http_status = resp.status_code
                if resp.status_code != 200:
                    text = await _read_some(resp, 2048)
                    rec.status = RequestStatus.HTTP_ERROR
                    rec.error = f"HTTP {resp.status_code}: {_error_text(text)}"
                else:
                    async for chunk in resp.aiter_bytes():
                        reader.feed(chunk, self.clock())
                    reader.close()
        except asyncio.CancelledError:
            rec.status = RequestStatus.CANCELLED
            self._finish(rec)
            raise
        except httpx.TimeoutException as exc:
            rec.status = RequestStatus.TIMED_OUT
            rec.error = f"{type(exc).__name__}: no response within the timeout"
        except (SSEProtocolError, _ServerStreamError) as exc:
            rec.status = RequestStatus.ERROR
            rec.error = str(exc)
        except (httpx.HTTPError, OSError) as exc:
            rec.status = RequestStatus.ERROR
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        self._finish(rec)
        return rec

    async def _one_raw_request(self, conn: RawConnection) -> RequestRecord:
        """One streaming request on this client's own connection (kvdiag.load.rawhttp)."""
        now = self.clock()
        rec = RequestRecord(start=now, issued=now)
        self.sent += 1
        self.in_flight += 1
        reader = StreamReader(rec, self._token)

        def sent() -> None:
            rec.start = self.clock()

        try:
            status, body = await conn.exchange(self._request, sent)
            rec.http_status = status
            if status != 200:
                buf = bytearray()
                async for chunk in body:
                    if len(buf) < 2048:
                        buf += chunk
                rec.status = RequestStatus.HTTP_ERROR
                rec.error = f"HTTP {status}: {_error_text(bytes(buf[:2048]).decode('utf-8', errors='replace'))}"
            else:
                clock = self.clock
                async for chunk in body:
                    reader.feed(chunk, clock())
                reader.close()
        except asyncio.CancelledError:
            conn.close()
            rec.status = RequestStatus.CANCELLED
            self._finish(rec)
            raise
        except RawTimeout as exc:
            rec.status = RequestStatus.TIMED_OUT
            rec.error = str(exc)
        except (SSEProtocolError, _ServerStreamError) as exc:
            conn.close()
            rec.status = RequestStatus.ERROR
            rec.error = str(exc)
        except RawHTTPError as exc:
            rec.status = RequestStatus.ERROR
            rec.error = str(exc)[:300]
        self._finish(rec)
        return rec

    def _finish(self, rec: RequestRecord) -> None:
        rec.end = self.clock()
        self.in_flight -= 1
        if self.in_flight <= 0 and self.drain_started_at is not None and self.drain_ended_at is None:
            self.drain_ended_at = rec.end
        if rec.ttft_s is not None:
            self.ttft.add(rec.ttft_s)
        self.itl.extend(rec.itl_s)
        st = rec.status
        if st is RequestStatus.OK:
            self.ok += 1
        elif st is RequestStatus.CANCELLED:
            self.cancelled += 1
        elif st is RequestStatus.TIMED_OUT:
            self.timed_out += 1
        else:
            self.failed += 1
            if st is RequestStatus.HTTP_ERROR:
                self.http_errors += 1
        if st in (RequestStatus.OK, RequestStatus.HTTP_ERROR, RequestStatus.ERROR):
            self.progress += 1
            self.last_progress_t = rec.end
        if rec.usage_tokens is not None and rec.usage_tokens > rec.tokens:
            self.usage_extra_tokens += rec.usage_tokens - rec.tokens
        if rec.error:
            self.last_error = rec.error
            if self.first_error is None:
                self.first_error = rec.error
        self.records.append(rec)

    # -- results -----------------------------------------------------------------------------------
    def summary(self, stalled: bool = False, stall_after_s: float | None = None) -> SoakSummary:
        now = self.clock()
        start = self.started_at if self.started_at is not None else now
        end = self.load_ended_at if self.load_ended_at is not None else (
            self.stopped_at if self.stopped_at is not None else now)
        drain_s: float | None = None
        if self.drain_started_at is not None:
            drain_end = self.drain_ended_at if self.drain_ended_at is not None else now
            drain_s = max(0.0, drain_end - self.drain_started_at)
        return SoakSummary(
            duration_s=max(0.0, end - start), requests_sent=self.sent, requests_ok=self.ok,
            requests_failed=self.failed, requests_timed_out=self.timed_out,
            requests_cancelled=self.cancelled + self.in_flight, tokens=self.tokens + self.usage_extra_tokens,
            ttft=LatencySummary.of(self.ttft), itl=LatencySummary.of(self.itl),
            stalled=stalled, stall_after_s=stall_after_s,
            drain_s=drain_s, drain_in_flight=self.drain_in_flight if drain_s is not None else None,
            drain_cut=self.drain_cut if drain_s is not None else None,
        )


async def _read_some(resp: httpx.Response, limit: int) -> str:
    buf = bytearray()
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if len(buf) >= limit:
            break
    return bytes(buf[:limit]).decode("utf-8", errors="replace")


def _error_text(text: str) -> str:
    """The message of an OpenAI-style error body, else the body's start."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:200]
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:200]
        return str(err)[:200]
    return text.strip()[:200]
