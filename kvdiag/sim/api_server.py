"""The simulated engine's API server: vLLM's process, log lines, routes and SSE framing.

Order of events copies ``vllm serve``: bind the port (not listening yet, so connections are
refused during startup), spawn EngineCore, wait for its handshake, log the routes, then uvicorn
starts and logs ``Application startup complete.``. SIGTERM/SIGINT stop EngineCore at once
(SIGTERM then SIGKILL, vLLM's ``mode=abort timeout=0s``) and then the HTTP server.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, MutableMapping
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvdiag.sim import vlog
from kvdiag.sim.client import EngineCoreClient, EngineDeadError, EngineStartupError, RequestState
from kvdiag.sim.config import SimConfig, parse_args
from kvdiag.sim.core import VLLM_VERSION
from kvdiag.sim.metrics import MetricsRegistry
from kvdiag.sim.tokens import VOCAB, VOCAB_JSON, count_chat_tokens, count_prompt_tokens

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-kvdiag-sim"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"vary", b"Origin"),
                (b"transfer-encoding", b"chunked")]
_DONE = b"data: [DONE]\n\n"


def _dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def _error(message: str, err_type: str = "BadRequestError", code: int = 400, param: str | None = None) -> Response:
    return JSONResponse(_error_body(message, err_type, code, param), status_code=code)


class StreamRenderer:
    """Pre-built halves of every SSE event of one request, so a token costs two string joins."""

    def __init__(self, chat: bool, rid_hex: str, created: int, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.include_usage = include_usage
        m = _dumps(model)
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
        return (f'data: {self.head}"choices":[],"usage":{_dumps(usage)},'
                f'"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n').encode()


class SSEResponse:
    """A raw ASGI streaming response: coalesces the tokens that arrived since the last write."""

    def __init__(self, server: SimApiServer, st: RequestState, renderer: StreamRenderer) -> None:
        self.server = server
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
                    self.server.client.abort_request(st)
                    return
                if st.error is not None:
                    body = f"data: {_dumps(_error_body(st.error, 'InternalServerError', 500))}\n\n".encode()
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
                self.server.client.abort_request(st)


class SimApiServer:
    """The HTTP side: routes, the engine client, periodic stats logging, shutdown."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.log = vlog.get_logger()
        self.metrics = MetricsRegistry(cfg.name)
        self.client = EngineCoreClient(cfg, self.metrics)
        self.client.on_dead = self._on_engine_dead
        self.uvicorn: _Server | None = None
        self.exit_code = 0
        self.shutdown_started = False
        self.started_at = int(time.time())
        self.app = Starlette(routes=self._routes(), lifespan=self._lifespan)

    # -- routes ---------------------------------------------------------------------------------------
    def _routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/load", self.load, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]

    async def health(self, request: Request) -> Response:
        if self.client.dead:
            return Response(status_code=503)
        return Response(status_code=200)

    async def metrics_endpoint(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def load(self, request: Request) -> Response:
        return JSONResponse({"server_load": len(self.client.requests)})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": f"{VLLM_VERSION}+kvdiag.sim"})

    async def models(self, request: Request) -> Response:
        name = self.cfg.name
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.started_at, "owned_by": "vllm", "root": self.cfg.model,
            "parent": None, "max_model_len": self.cfg.max_model_len,
            "permission": [{"id": f"modelperm-{random.getrandbits(64):016x}", "object": "model_permission",
                            "created": self.started_at, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]}]})

    async def _parse(self, request: Request) -> dict[str, Any] | Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(f"Invalid JSON body: {exc}")
        if not isinstance(body, dict):
            return _error("The request body must be a JSON object.")
        model = body.get("model")
        if model is not None and model not in (self.cfg.name, self.cfg.model):
            return _error(f"The model `{model}` does not exist.", "NotFoundError", 404, "model")
        return body

    def _admit(self, body: dict[str, Any], prompt_tokens: int, default_max: int | None) -> RequestState | Response:
        raw = body.get("max_completion_tokens", body.get("max_tokens"))
        limit = self.cfg.max_model_len
        if raw is None:
            max_tokens = default_max if default_max is not None else limit - prompt_tokens
        elif isinstance(raw, int) and not isinstance(raw, bool) and raw >= 1:
            max_tokens = raw
        else:
            return _error("max_tokens must be a positive integer.", param="max_tokens")
        if prompt_tokens + max_tokens > limit:
            return _error(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.", param="max_tokens")
        try:
            return self.client.add_request(prompt_tokens, max_tokens)
        except EngineDeadError as exc:
            return _error(str(exc), "InternalServerError", 500)

    async def completions(self, request: Request) -> Response | SSEResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response | SSEResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response | SSEResponse:
        body = await self._parse(request)
        if isinstance(body, Response):
            return body
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return _error("messages must be a non-empty list.", param="messages")
            prompt_tokens = count_chat_tokens(messages)
            default_max = None
        else:
            if "prompt" not in body:
                return _error("prompt is required.", param="prompt")
            prompt_tokens = count_prompt_tokens(body["prompt"])
            default_max = 16
        st = self._admit(body, prompt_tokens, default_max)
        if isinstance(st, Response):
            return st
        opts = body.get("stream_options")
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        renderer = StreamRenderer(chat, f"{random.getrandbits(64):016x}", int(time.time()), self.cfg.name,
                                  include_usage)
        if body.get("stream"):
            return SSEResponse(self, st, renderer)
        ids: list[int] = []
        try:
            while not st.done or st.tokens:
                ids += await st.next_batch()
        except asyncio.CancelledError:
            self.client.abort_request(st)
            raise
        if st.error is not None:
            return _error(st.error, "InternalServerError", 500)
        return Response(self._full_body(chat, renderer, st, ids), media_type="application/json")

    def _full_body(self, chat: bool, r: StreamRenderer, st: RequestState, ids: list[int]) -> bytes:
        text = "".join(VOCAB[i] for i in ids)
        usage: dict[str, Any] = {"prompt_tokens": st.prompt_tokens, "total_tokens": st.prompt_tokens + len(ids),
                                 "completion_tokens": len(ids), "prompt_tokens_details": None}
        created = int(time.time())
        if chat:
            out: dict[str, Any] = {
                "id": r.id, "object": "chat.completion", "created": created, "model": self.cfg.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                                     "annotations": None, "audio": None, "function_call": None,
                                                     "tool_calls": [], "reasoning": None},
                             "logprobs": None, "finish_reason": st.finish_reason, "stop_reason": None,
                             "token_ids": None}],
                "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage,
                "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None}
        else:
            usage["completion_tokens_details"] = None
            out = {
                "id": r.id, "object": "text_completion", "created": created, "model": self.cfg.name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": st.finish_reason,
                             "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                             "prompt_token_ids": None, "routed_experts": None}],
                "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage,
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        return _dumps(out).encode()

    # -- lifecycle ------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.client.attach(asyncio.get_running_loop())
        task = asyncio.get_running_loop().create_task(self._log_stats_loop())
        try:
            yield
        finally:
            task.cancel()

    async def _log_stats_loop(self) -> None:
        interval = self.cfg.log_stats_interval_s
        if interval <= 0:
            return
        last_t = time.monotonic()
        last = dict(self.metrics.stats)
        last_idle = True
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            s = self.metrics.stats
            dt = max(now - last_t, 1e-9)
            prompt_tp = (s.get("prompt_tokens", 0.0) - last.get("prompt_tokens", 0.0)) / dt
            gen_tp = (s.get("generation_tokens", 0.0) - last.get("generation_tokens", 0.0)) / dt
            idle = not (s.get("running", 0.0) or s.get("waiting", 0.0) or prompt_tp or gen_tp)
            if not (idle and last_idle):
                self.log.info("Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                              "tokens/s, Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix "
                              "cache hit rate: 0.0%%", prompt_tp, gen_tp, s.get("running", 0.0),
                              s.get("waiting", 0.0), 100.0 * s.get("kv_usage", 0.0))
            last_t, last, last_idle = now, dict(s), idle

    def _on_engine_dead(self) -> None:
        if self.shutdown_started or self.client.stopping:
            return
        log = self.log
        log.warning("[shutdown] MPClient: engine core exited unexpectedly; starting cleanup")
        log.info("[shutdown] MPClient: start timeout=default")
        log.info("[shutdown] MPClient: stopping engine manager")
        self.client.proc.join(timeout=1.0)
        log.info("[shutdown] MPClient: engine manager stopped")
        log.info("[shutdown] MPClient: cleaning up background resources")
        log.info("[shutdown] MPClient: complete")
        try:
            raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        except EngineDeadError:
            log.exception("AsyncLLM output_handler failed.")
        self.exit_code = 1
        if os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0") in ("1", "true", "True"):
            return
        loop = asyncio.get_running_loop()
        loop.call_later(max(0.0, self.cfg.engine_dead_exit_s), self._exit_after_engine_death)

    def _exit_after_engine_death(self) -> None:
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    def shutdown_engine(self) -> None:
        """vLLM's shutdown sequence (log lines included); safe to call more than once."""
        if self.shutdown_started:
            return
        self.shutdown_started = True
        log = self.log
        log.info("[shutdown] API server: shutdown triggered")
        log.info("[shutdown] API server: stopping engine client mode=abort timeout=0s")
        log.info("[shutdown] MPClient: start timeout=0s")
        log.info("[shutdown] MPClient: stopping engine manager")
        self.client.kill_engine()
        log.info("[shutdown] MPClient: engine manager stopped")
        log.info("[shutdown] MPClient: cleaning up background resources")
        log.info("[shutdown] MPClient: complete")
        log.info("[shutdown] API server: engine client stopped")
        log.info("[shutdown] API server: signalling HTTP server shutdown")
        log.info("[shutdown] API server: shutting down FastAPI HTTP server")

    def shutdown_engine_quiet(self) -> None:
        """Make sure EngineCore is gone when the server loop ends for any reason."""
        if not self.shutdown_started:
            self.shutdown_started = True
            self.client.kill_engine(log_lines=False)

    def log_routes(self) -> None:
        log = self.log
        log.info("Supported tasks: ['generate']")
        log.info("Starting vLLM server on http://%s:%d", self.cfg.host, self.cfg.port)
        log.info("Available routes are:")
        for route in self.app.routes:
            if isinstance(route, Route):
                methods = ", ".join(sorted(route.methods or [], key=lambda m: (m != "HEAD", m)))
                log.info("Route: %s, Methods: %s", route.path, methods)


class _Server(uvicorn.Server):
    """uvicorn with vLLM's signal handling: stop EngineCore first, exit 0, don't re-raise the signal."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        super().handle_exit(sig, frame)


def _bind(host: str, port: int) -> socket.socket:
    """Bind without listening, as vLLM does before it spawns EngineCore: clients are refused until ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP; without it
    # a response's headers and body go out as two segments and the body waits out the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def serve(cfg: SimConfig) -> int:
    """Run the API server (and its EngineCore) until a signal or engine death; returns the exit code."""
    try:
        return _serve(cfg)
    finally:
        _drop_device_files(cfg.device_name)


def _drop_device_files(device_name: str) -> None:
    """Remove the modelled device's /dev/shm files once no live process uses them.

    EngineCore ends with os._exit or SIGKILL (like vLLM's), so its allocator never unlinks them;
    the API server, which has reaped it by now, does. Co-located engines still running on the
    same device keep the files (the native check looks for live users under the file's lock).
    """
    try:
        importlib.import_module("kvdiag._native").remove_stale_device_files(device_name)
    except Exception:  # noqa: BLE001 - no native module: no files were made; never mask the exit
        pass


def _serve(cfg: SimConfig) -> int:
    log = vlog.setup("APIServer")
    log.info("kvdiag simulated engine (not vLLM) serving model %s; the EngineCore runs the %s page allocator",
             cfg.name, cfg.allocator)
    log.info("non-default args: %s", cfg.non_default())
    try:
        sock = _bind(cfg.host, cfg.port)
    except OSError as exc:
        log.error("Failed to bind %s:%d: %s", cfg.host, cfg.port, exc)
        return 1
    server = SimApiServer(cfg)
    stop_requested = False

    def on_startup_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        stop_requested = True

    previous = {sig: signal.signal(sig, on_startup_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.client.start()
        try:
            server.client.wait_ready(lambda: stop_requested)
        except EngineStartupError as exc:
            if stop_requested:
                server.shutdown_engine()
                return 0
            server.client.kill_engine(log_lines=False)
            try:
                raise RuntimeError(str(exc)) from None
            except RuntimeError:
                log.exception("EngineCore failed to start; the API server exits.")
            return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop_requested:
        server.shutdown_engine()
        return 0
    server.log_routes()
    config = uvicorn.Config(server.app, host=cfg.host, port=cfg.port, log_level="info",
                            access_log=cfg.access_log, timeout_graceful_shutdown=2, lifespan="on")
    userver = _Server(config, server.shutdown_engine)
    server.uvicorn = userver
    try:
        asyncio.run(userver.serve(sockets=[sock]))
    finally:
        server.shutdown_engine_quiet()
        sock.close()
    vlog.flush()
    return server.exit_code


def main(argv: list[str] | None = None) -> int:
    """`python -m kvdiag.sim [serve] ...`."""
    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    return serve(cfg)
