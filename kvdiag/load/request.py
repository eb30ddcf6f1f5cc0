"""One streaming request, over either transport, and what the clients send.

:class:`LoadConfig` says what every client sends and how long it waits. :func:`stream_over_httpx` and
:func:`stream_over_raw` send one request and read its SSE body into a :class:`StreamReader`, the
request's start moved to the moment its bytes go out; they set the record's status and error, and let a
cancellation through (the caller counts it). Against a plain http:// server the clients speak HTTP/1.1
themselves (:mod:`kvdiag.load.rawhttp`); an injected httpx transport or https uses httpx.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from typing import Any

import httpx

from kvdiag.defaults import Clock
from kvdiag.load.rawhttp import RawConnection, RawHTTPError, RawTimeout
from kvdiag.load.sse import SSEProtocolError
from kvdiag.load.stream import RequestRecord, RequestStatus, ServerStreamError, StreamReader

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
DEFAULT_PROMPT = ("You are a GPU memory allocator. Describe, step by step and at length, how a KV cache "
                  "page moves between the free list, the reserved list and a running request.")


_JSON = {"content-type": "application/json"}


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


async def stream_over_httpx(client: httpx.AsyncClient, cfg: LoadConfig, body: bytes, rec: RequestRecord,
                            reader: StreamReader, clock: Clock) -> None:
    """Send one request through httpx and read its stream into ``reader``; sets ``rec``'s status and error."""
    try:
        stamp = _SendStamp(rec, clock)
        async with client.stream("POST", cfg.endpoint, content=body, headers=_JSON,
                                 extensions={"trace": stamp}) as resp:
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                text = await _read_some(resp, 2048)
                rec.status = RequestStatus.HTTP_ERROR
                rec.error = f"HTTP {resp.status_code}: {_error_text(text)}"
            else:
                async for chunk in resp.aiter_bytes():
                    reader.feed(chunk, clock())
                reader.close()
    except httpx.TimeoutException as exc:
        rec.status = RequestStatus.TIMED_OUT
        rec.error = f"{type(exc).__name__}: no response within the timeout"
    except (SSEProtocolError, ServerStreamError) as exc:
        rec.status = RequestStatus.ERROR
        rec.error = str(exc)
    except (httpx.HTTPError, OSError) as exc:
        rec.status = RequestStatus.ERROR
        rec.error = f"{type(exc).__name__}: {exc}"[:300]


async def stream_over_raw(conn: RawConnection, request: bytes, rec: RequestRecord, reader: StreamReader,
                          clock: Clock) -> None:
    """Send one request on a client's own connection and read its stream into ``reader``; sets ``rec``'s
    status and error. A cancelled or garbled stream closes the connection (its next request opens a new one)."""

    def sent() -> None:
        rec.start = clock()

    try:
        status, body = await conn.exchange(request, sent)
        rec.http_status = status
        if status != 200:
            buf = bytearray()
            async for chunk in body:
                if len(buf) < 2048:
                    buf += chunk
            rec.status = RequestStatus.HTTP_ERROR
            rec.error = f"HTTP {status}: {_error_text(bytes(buf[:2048]).decode('utf-8', errors='replace'))}"
        else:
            async for chunk in body:
                reader.feed(chunk, clock())
            reader.close()
    except asyncio.CancelledError:
        conn.close()
        raise
    except RawTimeout as exc:
        rec.status = RequestStatus.TIMED_OUT
        rec.error = str(exc)
    except (SSEProtocolError, ServerStreamError) as exc:
        conn.close()
        rec.status = RequestStatus.ERROR
        rec.error = str(exc)
    except RawHTTPError as exc:
        rec.status = RequestStatus.ERROR
        rec.error = str(exc)[:300]


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
