"""One streamed request as the load client sees it: its record, and the reading of its SSE events
(completions or chat) into token timings."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvdiag.load.sse import SSEParser, SSEProtocolError


class RequestStatus(str, Enum):
    OK = "ok"                  # 200, stream ended with [DONE]
    HTTP_ERROR = "http_error"  # non-200 status
    TIMED_OUT = "timed_out"    # connect/read/write/pool timeout
    ERROR = "error"            # connection refused/reset, stream cut, malformed SSE, error event
    CANCELLED = "cancelled"    # stopped by the soak (duration over, stall captured, Ctrl-C)


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
            raise ServerStreamError(str(msg)[:300])
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


class ServerStreamError(Exception):
    """The server sent an error object inside the stream."""
