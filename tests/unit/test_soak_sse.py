"""The incremental SSE parser: chunk boundaries anywhere give the same events as one whole body."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.load.sse import SSEEvent, SSEParser, SSEProtocolError

VLLM = Path(__file__).resolve().parents[2].parent / "shared" / "vllm"


def _vllm_body(n: int = 6) -> bytes:
    """A completions stream framed the way vLLM frames it: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""
    texts = ["igh", "~", "", "\ufffdz", "ssist", "caf\u00e9 \u20ac"][:n]
    out = []
    for i, t in enumerate(texts):
        obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "/tmp/tiny-llama",
               "choices": [{"index": 0, "text": t, "logprobs": None,
                            "finish_reason": "length" if i == len(texts) - 1 else None, "stop_reason": None}]}
        out.append(f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n")
    out.append("data: [DONE]\n\n")
    return "".join(out).encode()


def _parse_chunks(chunks: list[bytes]) -> list[SSEEvent]:
    p = SSEParser()
    events: list[SSEEvent] = []
    for c in chunks:
        events += p.feed(c)
    events += p.close()
    return events


def _cut(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(body)})
    out, prev = [], 0
    for c in points:
        out.append(body[prev:c])
        prev = c
    out.append(body[prev:])
    return out


def test_whole_vllm_body() -> None:
    events = _parse_chunks([_vllm_body()])
    assert len(events) == 7
    assert events[-1].is_done and not events[0].is_done
    texts = [json.loads(e.data)["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["igh", "~", "", "\ufffdz", "ssist", "caf\u00e9 \u20ac"]
    assert all(e.event == "message" and e.id is None for e in events)


def test_every_two_chunk_split_gives_the_same_events() -> None:
    body = _vllm_body()
    whole = _parse_chunks([body])
    for i in range(1, len(body)):
        assert _parse_chunks([body[:i], body[i:]]) == whole, f"split at byte {i}"


def test_byte_by_byte() -> None:
    body = _vllm_body()
    assert _parse_chunks([body[i:i + 1] for i in range(len(body))]) == _parse_chunks([body])


def test_chunk_ending_in_data_space_keeps_the_space() -> None:
    # vllm bench's reader strips each chunk: `data: ` + `{...}` became `data:{...}` and then broke.
    body = b'data: {"a":1}\n\ndata: '
    p = SSEParser()
    assert [e.data for e in p.feed(body)] == ['{"a":1}']
    assert [e.data for e in p.feed(b' {"b":2}\n\n')] == [' {"b":2}']  # only ONE leading space is removed
    p2 = SSEParser()
    p2.feed(b"data: ")
    assert [e.data for e in p2.feed(b'{"b":2}\n\n')] == ['{"b":2}']


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=1200), max_size=40))
def test_random_chunkings(cuts: list[int]) -> None:
    body = _vllm_body()
    assert _parse_chunks(_cut(body, cuts)) == _parse_chunks([body])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=400), max_size=20), st.sampled_from(["\n", "\r\n", "\r"]))
def test_line_endings_split_anywhere(cuts: list[int], eol: str) -> None:
    text = f"data: one{eol}data: two{eol}{eol}: comment{eol}event: update{eol}id: 7{eol}data: three{eol}{eol}"
    body = text.encode()
    events = _parse_chunks(_cut(body, cuts))
    assert events == [SSEEvent(data="one\ntwo"), SSEEvent(data="three", event="update", id="7")]


def test_crlf_cut_between_cr_and_lf_is_one_line_ending() -> None:
    p = SSEParser()
    assert p.feed(b"data: x\r") == []
    assert p.feed(b"\n") == []
    assert p.feed(b"\r") == [SSEEvent(data="x")]
    assert p.feed(b"\n") == []           # the LF of that CRLF: not a second blank line
    assert not p.pending


def test_utf8_sequence_cut_across_chunks() -> None:
    raw = "data: \u20ac\n\n".encode()
    cut = raw.index(b"\xe2") + 1
    assert _parse_chunks([raw[:cut], raw[cut:]]) == [SSEEvent(data="\u20ac")]


def test_field_rules() -> None:
    events = _parse_chunks([b"data\n\ndata:x\n\n:keepalive\n\nretry: 10\nfoo: bar\n\nevent: only\n\ndata:  y\n\n"])
    # "data" with no colon is an empty data line; the event-only block has no data and is not dispatched
    assert events == [SSEEvent(data=""), SSEEvent(data="x"), SSEEvent(data=" y")]


def test_unterminated_event_is_dropped_at_close() -> None:
    p = SSEParser()
    assert p.feed(b"data: {\"partial\": 1}\n") == []
    assert p.pending
    assert p.close() == []
    assert not p.pending


def test_over_long_line_is_an_error() -> None:
    p = SSEParser(max_line=100)
    with pytest.raises(SSEProtocolError):
        for _ in range(20):
            p.feed(b"x" * 10)


def test_captured_vllm_stream_if_present() -> None:
    path = VLLM / "stream.txt"
    if not path.exists():
        pytest.skip("shared vLLM captures not present")
    text = path.read_text(encoding="utf-8")
    section = text.split("### 2)")[0]
    body = section[section.index("data: "):].rstrip("\n") + "\n\n"
    events = _parse_chunks([body.encode()[i:i + 7] for i in range(0, len(body.encode()), 7)])
    assert events[-1].is_done
    assert len(events) == 6
    assert all(json.loads(e.data)["object"] == "text_completion" for e in events[:-1])
