"""Incremental Server-Sent Events parser for OpenAI-style streaming responses.

Network chunks arrive cut anywhere: inside a UTF-8 sequence, inside ``data:``,
between ``\\r`` and ``\\n``. The parser keeps every byte of a partial line until
its line ending arrives and never strips chunk edges (the ``vllm bench`` reader
strips each chunk and turns ``data: `` + ``{...}`` into ``data:{...}``; see
../shared/vllm/README.md "Pitfalls"). Field handling follows the WHATWG SSE
rules: one optional space after the colon is removed, ``data`` lines join with
``\\n``, a blank line dispatches, lines starting with ``:`` are comments, and an
event still open when the stream ends is dropped.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

DONE = "[DONE]"


class SSEProtocolError(ValueError):
    """The stream broke an SSE limit (a line longer than ``max_line``)."""


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: its joined ``data`` and the optional ``event``/``id`` fields."""

    data: str
    event: str = "message"
    id: str | None = None

    @property
    def is_done(self) -> bool:
        """The OpenAI end-of-stream sentinel ``data: [DONE]``."""
        return self.data == DONE


class SSEParser:
    """Feed raw bytes with :meth:`feed`; get the events completed by them."""

    def __init__(self, max_line: int = 8 * 1024 * 1024) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial: list[str] = []     # pieces of the line not yet ended
        self._partial_len = 0
        self._after_cr = False            # the previous chunk ended in "\r" (a "\n" may follow)
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._last_id: str | None = None
        self.max_line = max_line
        self.bytes_seen = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse one network chunk (any size, cut anywhere); returns the events it completed."""
        self.bytes_seen += len(chunk)
        return self.feed_text(self._decoder.decode(chunk))

    def feed_text(self, text: str) -> list[SSEEvent]:
        """Like :meth:`feed` for already-decoded text."""
        if not text:
            return []
        if self._after_cr and text[0] == "\n":
            text = text[1:]  # the "\n" of a "\r\n" cut between two chunks
            if not text:
                self._after_cr = False
                return []
        self._after_cr = text.endswith("\r")
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if "\n" not in text:
            self._keep_partial(text)
            return []
        lines = text.split("\n")
        if self._partial:
            lines[0] = "".join(self._partial) + lines[0]
            self._partial.clear()
            self._partial_len = 0
        tail = lines.pop()
        if tail:
            self._keep_partial(tail)
        events: list[SSEEvent] = []
        for line in lines:
            ev = self._line(line)
            if ev is not None:
                events.append(ev)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: flush the decoder; an unterminated event is dropped (SSE rule)."""
        rest = self._decoder.decode(b"", final=True)
        events = self.feed_text(rest) if rest else []
        self._partial.clear()
        self._partial_len = 0
        self._data.clear()
        self._event = ""
        return events

    @property
    def pending(self) -> bool:
        """True when bytes of an unfinished line or event are buffered."""
        return bool(self._partial or self._data)

    def _keep_partial(self, text: str) -> None:
        if not text:
            return
        self._partial.append(text)
        self._partial_len += len(text)
        if self._partial_len > self.max_line:
            raise SSEProtocolError(f"SSE line longer than {self.max_line} characters")

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line[0] == ":":
            return None  # comment / keep-alive
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._id = value
        # "retry" and unknown fields are ignored, as the SSE rules say.
        return None

    def _dispatch(self) -> SSEEvent | None:
        if self._id is not None:
            self._last_id = self._id
            self._id = None
        if not self._data:
            self._event = ""
            return None
        ev = SSEEvent(data="\n".join(self._data), event=self._event or "message", id=self._last_id)
        self._data.clear()
        self._event = ""
        return ev
