"""The simulated engine's streaming responses: vLLM's SSE events, pre-built per request, and the raw ASGI
response that writes them as tokens arrive."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvdiag.sim.client import EngineCoreClient, RequestState
from kvdiag.sim.core import VLLM_VERSION
from kvdiag.sim.tokens import VOCAB_JSON

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-kvdiag-sim"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"vary", b"Origin"),
                (b"transfer-encoding", b"chunked")]
_DONE = b"data: [DONE]\n\n"


def dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class StreamRenderer:
    """Pre-built halves of every SSE event of one request, so a token costs two string joins."""

    def __init__(self, chat: bool, rid_hex: str, created: int, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.include_usage = include_usage
        m = dumps(model)
        if chat:
            self.id = f"chatcmpl-{rid_hex}"
            head = f'{{"id":"{self.id}","object":"chat.completion.chunk","created":{created},"model":{m},'
            self.first = (f'data: {head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                          f'"logprobs":null,"finish_reason":null}}],"prompt_token_ids":null,"prompt_text":null}}'
                          "\n\n").encode()
            self.pre = f'data: {head}"choices":[{{"index":0,"delta":{{"content":'
            self.mid = '},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
            self.last_tail = '},"logprobs":null,"finish_reason":"@REASON@","stop_reason":null,"token_ids":null}]'
        else:
            self.id = f"cmpl-{rid_hex}"
            head = f'{{"id":"{self.id}","object":"text_completion","created":{created},"model":{m},'
            self.first = b""
            self.pre = f'data: {head}"choices":[{{"index":0,"text":'
            self.mid = (',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
                        '"token_ids":null}]}\n\n')
            self.last_tail = (',"logprobs":null,"finish_reason":"@REASON@","stop_reason":null,'
                              '"prompt_token_ids":null,"token_ids":null}]')
        self.head = head

    def tokens(self, ids: list[int], final_reason: str | None) -> bytes:
        pre, mid, vj = self.pre, self.mid, VOCAB_JSON
        if final_reason is None:
            return "".join([pre + vj[t] + mid for t in ids]).encode()
        parts = [pre + vj[t] + mid for t in ids[:-1]]
        tail = self.last_tail.replace("@REASON@", final_reason)
        if self.include_usage:
            parts.append(pre + vj[ids[-1]] + tail + "}\n\n")
        else:
            parts.append(pre + vj[ids[-1]] + tail + f',"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n')
        return "".join(parts).encode()

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                 "completion_tokens": completion_tokens}
        return (f'data: {self.head}"choices":[],"usage":{dumps(usage)},'
                f'"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n').encode()


class SSEResponse:
    """A raw ASGI streaming response: coalesces the tokens that arrived since the last write."""

    def __init__(self, client: EngineCoreClient, st: RequestState, renderer: StreamRenderer) -> None:
        self.client = client
        self.st = st
        self.r = renderer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        st, r = self.st, self.r
        disconnected = False

        async def watch_disconnect() -> None:
            nonlocal disconnected
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    disconnected = True
                    st.wake()
                    return

        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            first = True
            while True:
                batch = await st.next_batch()
                if disconnected:
                    self.client.abort_request(st)
                    return
                if st.error is not None:
                    body = f"data: {dumps(error_body(st.error, 'InternalServerError', 500))}\n\n".encode()
                    await send({"type": "http.response.body", "body": body + _DONE, "more_body": False})
                    return
                if not batch and not st.done:
                    continue
                chunk = b""
                if first and r.first:
                    chunk = r.first
                first = False
                final = st.finish_reason if (st.done and not st.tokens) else None
                if batch:
                    chunk += r.tokens(batch, final)
                if final is not None:
                    if r.include_usage:
                        chunk += r.usage(st.prompt_tokens, st.n_tokens)
                    await send({"type": "http.response.body", "body": chunk + _DONE, "more_body": False})
                    return
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            watcher.cancel()
            if not st.done:
                self.client.abort_request(st)
