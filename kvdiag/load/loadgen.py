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
import json
import time
from collections import deque

import httpx

from kvdiag.defaults import Clock
from kvdiag.load.rawhttp import RawConnection, RawHTTPError, RawTimeout, ReadDeadlines, plain_http
from kvdiag.load.request import LoadConfig, stream_over_httpx, stream_over_raw
from kvdiag.load.stats import LatencySummary, SampleReservoir, SoakSummary
from kvdiag.load.stream import RequestRecord, RequestStatus, StreamReader


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
            rec = await self._one_request(conn)
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

    async def _one_request(self, conn: RawConnection | None) -> RequestRecord:
        """One streaming request: on this client's own connection, else through httpx."""
        now = self.clock()
        rec = RequestRecord(start=now, issued=now)
        self.sent += 1
        self.in_flight += 1
        reader = StreamReader(rec, self._token)
        try:
            if conn is not None:
                await stream_over_raw(conn, self._request, rec, reader, self.clock)
            else:
                assert self._client is not None
                await stream_over_httpx(self._client, self.cfg, self._body, rec, reader, self.clock)
        except asyncio.CancelledError:
            rec.status = RequestStatus.CANCELLED
            self._finish(rec)
            raise
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


# LoadConfig is the generator's configuration: importable from here, beside the generator it configures.
__all__ = ["LoadGenerator"]
