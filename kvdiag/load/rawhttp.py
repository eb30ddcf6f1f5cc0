"""A lean HTTP/1.1 client on asyncio streams for the soak's hot path (plain http:// only).

Why not httpx here: a saturating soak reads one HTTP chunk per generated token on 32+ streams, and
httpx/httpcore/h11 decode each of them in pure Python layers; on a 2-core box that client CPU is taken
from the server it measures (`vllm bench serve`'s aiohttp client spends less than half of it per
request). This client keeps one keep-alive connection per soak stream, writes a prebuilt request,
reads the status line and headers with one ``readuntil`` and then each chunk of a chunked body with
``readuntil`` + ``readexactly``: one network chunk in, one ``bytes`` out, timed on arrival.

Timeouts never create tasks per read: every connection records when it last received a byte and
:class:`ReadDeadlines` (one task for all connections) aborts a connection that has been silent for
``read_timeout_s``; the pending read then fails and the request ends as timed out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

from kvdiag.defaults import Clock


class RawHTTPError(Exception):
    """The connection broke or the server answered outside HTTP/1.1 (message says how)."""


class RawTimeout(Exception):
    """No byte arrived for the read timeout (or the connection could not be opened in time)."""


def plain_http(base_url: str) -> bool:
    return urlsplit(base_url).scheme == "http"


class RawConnection:
    """One keep-alive HTTP/1.1 connection to ``base_url``'s host (reconnects when the server closed it)."""

    def __init__(self, base_url: str, connect_timeout_s: float, clock: Clock = time.monotonic) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.encode()
        self.connect_timeout_s = connect_timeout_s
        self.clock = clock
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_io = clock()
        self.busy = False
        self.timed_out = False

    def request_bytes(self, method: str, path: str, body: bytes = b"",
                      content_type: bytes = b"application/json") -> bytes:
        head = (f"{method} {self.prefix}{path} HTTP/1.1\r\n").encode() + b"Host: " + self.host_header + b"\r\n"
        if body or method == "POST":
            head += b"Content-Type: " + content_type + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
        return head + b"Accept: */*\r\nConnection: keep-alive\r\n\r\n" + body

    async def _connect(self) -> None:
        try:
            self.reader, self.writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), timeout=self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise RawTimeout(f"ConnectTimeout: no connection to {self.host}:{self.port} within "
                             f"{self.connect_timeout_s:g}s") from None
        except OSError as exc:
            raise RawHTTPError(f"ConnectError: {exc}") from None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()
        self.reader = self.writer = None

    async def exchange(self, request: bytes, on_sent: Callable[[], None] | None = None
                       ) -> tuple[int, AsyncIterator[bytes]]:
        """Send ``request``; returns the status and an iterator over the body's network chunks."""
        if self.writer is None or self.writer.is_closing() or (self.reader is not None and self.reader.at_eof()):
            self.close()
            await self._connect()
        assert self.reader is not None and self.writer is not None
        self.busy = True
        self.timed_out = False
        self.last_io = self.clock()
        self.writer.write(request)
        if on_sent is not None:
            on_sent()
        try:
            await self.writer.drain()
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as exc:
            self.busy = False
            self.close()
            raise self._broken(exc) from None
        self.last_io = self.clock()
        status, chunked, length, close = _parse_head(head)
        return status, self._body(chunked, length, close)

    def _broken(self, exc: BaseException) -> Exception:
        if self.timed_out:
            return RawTimeout("ReadTimeout: no byte within the read timeout")
        if isinstance(exc, asyncio.IncompleteReadError):
            return RawHTTPError("RemoteProtocolError: the server closed the connection mid-response")
        return RawHTTPError(f"{type(exc).__name__}: {exc}")

    async def _body(self, chunked: bool, length: int | None, close: bool) -> AsyncIterator[bytes]:
        reader = self.reader
        assert reader is not None
        done = False
        try:
            if chunked:
                while True:
                    line = await reader.readuntil(b"\r\n")
                    try:
                        size = int(line.split(b";", 1)[0], 16)
                    except ValueError:
                        raise RawHTTPError(f"RemoteProtocolError: bad chunk size line {line[:40]!r}") from None
                    if size == 0:
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    self.last_io = self.clock()
                    yield data[:-2]
            elif length is not None:
                left = length
                while left > 0:
                    data = await reader.read(min(left, 65536))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    self.last_io = self.clock()
                    yield data
            else:  # read to EOF (Connection: close)
                close = True
                while True:
                    data = await reader.read(65536)
                    if not data:
                        break
                    self.last_io = self.clock()
                    yield data
            done = True
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as exc:
            self.close()
            raise self._broken(exc) from None
        finally:
            self.busy = False
            if not done or close:
                self.close()   # a body not read to its end leaves the connection unusable


def _parse_head(head: bytes) -> tuple[int, bool, int | None, bool]:
    """(status, chunked, content length, connection close) from a response head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise RawHTTPError(f"RemoteProtocolError: not an HTTP/1.1 response: {lines[0][:60]!r}")
    try:
        status = int(parts[1])
    except ValueError:
        raise RawHTTPError(f"RemoteProtocolError: bad status line {lines[0][:60]!r}") from None
    chunked = False
    length: int | None = None
    close = parts[0] == b"HTTP/1.0"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif key == b"content-length":
            try:
                length = int(value.strip())
            except ValueError:
                raise RawHTTPError("RemoteProtocolError: bad Content-Length") from None
        elif key == b"connection":
            close = value.strip().lower() == b"close"
    if status in (204, 304) or 100 <= status < 200:
        length = 0
    return status, chunked, length, close


class ReadDeadlines:
    """One task that aborts every busy connection silent for longer than ``read_timeout_s``."""

    def __init__(self, read_timeout_s: float, clock: Clock = time.monotonic) -> None:
        self.read_timeout_s = read_timeout_s
        self.clock = clock
        self.connections: list[RawConnection] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvdiag-soak-read-deadlines")

    async def _run(self) -> None:
        period = max(0.05, min(1.0, self.read_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = self.clock()
            for c in self.connections:
                if c.busy and now - c.last_io > self.read_timeout_s:
                    c.timed_out = True
                    c.close()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        for c in self.connections:
            c.close()
