"""The API server's side of EngineCore: spawn it, hand it requests, route its outputs to streams.

Nothing here may block the event loop on EngineCore: requests go out through a sender thread
and outputs come in on a reader thread, so a hung EngineCore leaves /health and /metrics
answering (with stale stats), exactly as vLLM's API server behaves (stall.txt).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from kvdiag.sim import protocol as P
from kvdiag.sim import vlog
from kvdiag.sim.config import SimConfig
from kvdiag.sim.core import run_engine_core
from kvdiag.sim.metrics import MetricsRegistry


class EngineDeadError(Exception):
    """vLLM's name for "EngineCore is gone"."""


class EngineStartupError(Exception):
    """EngineCore died (or was asked to stop) before it reported ready."""


class RequestState:
    """One in-flight request as the API server sees it."""

    __slots__ = ("rid", "arrival", "prompt_tokens", "max_tokens", "tokens", "waiter", "finish_reason",
                 "first_t", "last_t", "error", "n_tokens")

    def __init__(self, rid: int, arrival: float, prompt_tokens: int, max_tokens: int) -> None:
        self.rid = rid
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.tokens: list[int] = []          # produced, not yet consumed by the response writer
        self.waiter: asyncio.Future[None] | None = None
        self.finish_reason: str | None = None
        self.first_t = 0.0
        self.last_t = 0.0
        self.error: str | None = None
        self.n_tokens = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next_batch(self) -> list[int]:
        """Tokens produced since the last call; waits while there are none and the request runs."""
        while not self.tokens and not self.done:
            loop = asyncio.get_running_loop()
            self.waiter = loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        batch, self.tokens = self.tokens, []
        return batch


class EngineCoreClient:
    """Owns the EngineCore process and the request table."""

    def __init__(self, cfg: SimConfig, metrics: MetricsRegistry) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.log = vlog.get_logger()
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc: BaseProcess = ctx.Process(target=run_engine_core, args=(cfg, child_conn, os.getpid()),
                                             name="EngineCore", daemon=True)
        self._child_conn: Connection | None = child_conn
        self.requests: dict[int, RequestState] = {}
        self._next_rid = 1
        self._sendq: queue.Queue[P.Message | None] = queue.Queue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead = False
        self.dead_reason: str | None = None
        self.stopping = False
        self.ready_info: dict[str, Any] = {}
        self.on_dead: Callable[[], None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        self.proc.start()
        if self._child_conn is not None:
            self._child_conn.close()  # only EngineCore holds its end: EOF means it is gone
            self._child_conn = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def wait_ready(self, should_stop: Callable[[], bool]) -> dict[str, Any]:
        """Block until EngineCore reports ready (no timeout: a hung KV init hangs here, as in vLLM)."""
        while True:
            if should_stop():
                raise EngineStartupError("shutdown requested during startup")
            try:
                if self.conn.poll(0.1):
                    msg = self.conn.recv()
                    if msg[0] == P.READY:
                        self.ready_info = dict(msg[1])
                        return self.ready_info
                    if msg[0] == P.ERROR:
                        self.dead_reason = str(msg[1])
                    continue
            except (EOFError, OSError):
                pass
            if not self.proc.is_alive():
                self.proc.join(timeout=1.0)
                raise EngineStartupError(
                    "Engine core initialization failed. See root cause above. "
                    f"Failed core proc(s): {{'EngineCore': {self.proc.exitcode}}}")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the pipe threads once the server's event loop runs."""
        self.loop = loop
        threading.Thread(target=self._sender, name="engine_core_sender", daemon=True).start()
        threading.Thread(target=self._reader, name="engine_core_output", daemon=True).start()

    def kill_engine(self, log_lines: bool = True) -> None:
        """vLLM's abort-mode shutdown: SIGTERM EngineCore, then SIGKILL whatever is left."""
        self.stopping = True
        pid = self.proc.pid
        if pid is None or not self.proc.is_alive():
            return
        log = self.log
        if log_lines:
            log.info("[shutdown] Process manager: send sigterm to process EngineCore")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        self.proc.join(timeout=0.05)
        if self.proc.is_alive():
            if log_lines:
                log.warning("[shutdown] Process manager: force killing remaining processes count=1")
                log.warning("[shutdown] Process manager: force killing remaining process EngineCore pid %d", pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.join(timeout=2.0)
        self._sendq.put(None)

    # -- pipe threads ---------------------------------------------------------------------------------
    def _sender(self) -> None:
        P.pump(self._sendq, self.conn)

    def _reader(self) -> None:
        conn = self.conn
        loop = self.loop
        assert loop is not None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            try:
                loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:  # loop closed during shutdown
                return
        try:
            loop.call_soon_threadsafe(self._engine_gone)
        except RuntimeError:
            pass

    # -- on the event loop ----------------------------------------------------------------------------
    def _dispatch(self, msg: P.Message) -> None:
        kind = msg[0]
        m = self.metrics
        if kind == P.OUTPUT:
            t = msg[1]
            reqs = self.requests
            itl = m.request_histograms["itl"]
            ttft = m.request_histograms["ttft"]
            for rid, tok in msg[2]:
                st = reqs.get(rid)
                if st is None:
                    continue
                st.tokens.append(tok)
                st.n_tokens += 1
                if st.first_t:
                    itl.observe(t - st.last_t)
                else:
                    st.first_t = t
                    ttft.observe(t - st.arrival)
                st.last_t = t
                w = st.waiter
                if w is not None and not w.done():
                    w.set_result(None)
            for fin in msg[3]:
                self._finish(fin, t)
            if msg[4] is not None:
                m.update_stats(msg[4], t)
        elif kind == P.STATS:
            m.update_stats(msg[2], msg[1])
        elif kind == P.ERROR:
            self.dead_reason = str(msg[1])

    def _finish(self, fin: P.FinishedTuple, t: float) -> None:
        rid, reason, scheduled_t, first_t, preemptions, n = fin
        st = self.requests.pop(rid, None)
        m = self.metrics
        m.success[reason] = m.success.get(reason, 0) + 1
        if st is None:
            return
        st.finish_reason = reason
        h = m.request_histograms
        h["e2e"].observe(t - st.arrival)
        h["queue"].observe(max(0.0, scheduled_t - st.arrival))
        h["inference"].observe(max(0.0, t - scheduled_t))
        h["prefill"].observe(max(0.0, first_t - scheduled_t))
        h["decode"].observe(max(0.0, t - first_t))
        h["prompt_tokens"].observe(st.prompt_tokens)
        h["generation_tokens"].observe(n)
        h["max_tokens"].observe(st.max_tokens)
        h["max_generation"].observe(st.max_tokens)
        h["preemptions"].observe(preemptions)
        if n > 1:
            h["tpot"].observe((t - first_t) / (n - 1))
        st.wake()

    def _engine_gone(self) -> None:
        if self.dead:
            return
        self.dead = True
        for st in list(self.requests.values()):
            st.error = "EngineCore encountered an issue. See stack trace (above) for the root cause."
            st.wake()
        self.requests.clear()
        if self.on_dead is not None:
            self.on_dead()

    # -- requests -------------------------------------------------------------------------------------
    def add_request(self, prompt_tokens: int, max_tokens: int) -> RequestState:
        if self.dead:
            raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        rid = self._next_rid
        self._next_rid += 1
        now = time.monotonic()
        st = RequestState(rid, now, prompt_tokens, max_tokens)
        self.requests[rid] = st
        self._sendq.put((P.ADD, rid, prompt_tokens, max_tokens, now))
        return st

    def abort_request(self, st: RequestState) -> None:
        if self.requests.pop(st.rid, None) is not None and not self.dead:
            self._sendq.put((P.ABORT, st.rid))
