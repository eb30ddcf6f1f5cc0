"""The EngineCore's scheduler: running/waiting queues over KV pages from the page allocator.

Each request holds ``ceil(tokens / tokens_per_page)`` pages, allocated with ``alloc_page`` as its
token count crosses a page boundary and freed with ``free_pages`` when it finishes. Like
vLLM's V1 scheduler, running requests are served first (a request that cannot get a page
preempts the most recently admitted one, which goes back to the front of the waiting queue and
recomputes), then waiting requests are admitted while there are pages and running slots.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from kvdiag.sim.protocol import FinishedTuple, TokenTuple
from kvdiag.sim.tokens import token_id


class PageAllocator(Protocol):
    """The part of kvdiag.allocator's page allocator the engine uses."""

    def alloc_page(self) -> int: ...
    def free_pages(self, page_ids: list[int]) -> None: ...
    def get_num_free_pages(self) -> int: ...
    def get_num_inuse_pages(self) -> int: ...
    def get_num_total_pages(self) -> int: ...
    def get_num_reserved_pages(self) -> int: ...
    def get_num_inflight_pages(self) -> int: ...


class OutOfMemoryError(RuntimeError):
    """The device has no room (torch.OutOfMemoryError in a real engine)."""


def is_oom_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "out of memory" in text or "no room" in text


def alloc_or_oom(alloc: PageAllocator) -> int:
    """alloc_page, with a full device reported the way an engine reports it: out of memory."""
    try:
        return alloc.alloc_page()
    except RuntimeError as exc:
        if is_oom_error(exc) and not isinstance(exc, OutOfMemoryError):
            raise OutOfMemoryError(f"CUDA out of memory while mapping KV cache pages: {exc}") from exc
        raise


class NoFreePages(Exception):
    """The pool has no page left for this allocation (the scheduler preempts or waits)."""


class Request:
    __slots__ = ("rid", "prompt", "max_tokens", "arrival", "generated", "pages", "scheduled_t", "first_t",
                 "preemptions")

    def __init__(self, rid: int, prompt: int, max_tokens: int, arrival: float) -> None:
        self.rid = rid
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.generated = 0
        self.pages: list[int] = []
        self.scheduled_t = 0.0
        self.first_t = 0.0
        self.preemptions = 0


class Scheduler:
    """Admission, page growth, preemption and token production for one engine."""

    def __init__(self, allocator: PageAllocator, max_running: int, tokens_per_page: int, seed: int = 0) -> None:
        self.alloc = allocator
        self.max_running = max_running
        self.tokens_per_page = tokens_per_page
        self.seed = seed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.held_pages = 0
        # One page is the null block; a request never needs more than the rest.
        self.usable_pages = max(1, allocator.get_num_total_pages() - 1)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_page)

    def add(self, rid: int, prompt: int, max_tokens: int, arrival: float) -> None:
        prompt = max(1, min(prompt, self.usable_pages * self.tokens_per_page - 1))
        max_tokens = max(1, min(max_tokens, self.usable_pages * self.tokens_per_page - prompt))
        req = Request(rid, prompt, max_tokens, arrival)
        self.requests[rid] = req
        self.waiting.append(req)

    def abort(self, rid: int, now: float) -> FinishedTuple | None:
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._release(req)
        return (rid, "abort", req.scheduled_t or now, req.first_t or now, req.preemptions, req.generated)

    # -- pages ---------------------------------------------------------------------------------------
    def _alloc(self, n: int) -> list[int]:
        """``n`` pages or NoFreePages (nothing kept). Free pages in flight or reserved count as free,
        exactly as the allocator's own counter does, so this never asks for a page that isn't there."""
        if self.alloc.get_num_free_pages() < n:
            raise NoFreePages()
        got: list[int] = []
        try:
            for _ in range(n):
                got.append(alloc_or_oom(self.alloc))
        except BaseException as exc:
            if got:
                self.alloc.free_pages(got)
            if isinstance(exc, RuntimeError) and "No free pages" in str(exc):
                raise NoFreePages() from exc
            raise
        self.held_pages += n
        return got

    def _release(self, req: Request) -> None:
        if req.pages:
            pages, req.pages = req.pages, []
            self.held_pages -= len(pages)
            self.alloc.free_pages(pages)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    # -- one step ------------------------------------------------------------------------------------
    def schedule(self, now: float) -> None:
        """Give every running request the page its next token needs, then admit waiting requests."""
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted by an earlier request of this step
            need = self.pages_for(req.prompt + req.generated + 1) - len(req.pages)
            while need > 0:
                try:
                    req.pages.extend(self._alloc(1))
                    need -= 1
                except NoFreePages:
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = self.pages_for(req.prompt + req.generated + 1)
            try:
                req.pages = self._alloc(need)
            except NoFreePages:
                break
            self.waiting.popleft()
            self.running.append(req)
            if not req.scheduled_t:
                req.scheduled_t = now
                self.prompt_tokens += req.prompt

    def update(self, now: float) -> tuple[list[TokenTuple], list[FinishedTuple]]:
        """The forward pass is over: one new token per running request; finished ones free their pages."""
        tokens: list[TokenTuple] = []
        finished: list[FinishedTuple] = []
        done: list[Request] = []
        seed = self.seed
        for req in self.running:
            tokens.append((req.rid, token_id(req.rid, req.generated, seed)))
            req.generated += 1
            if not req.first_t:
                req.first_t = now
            if req.generated >= req.max_tokens:
                done.append(req)
        self.generation_tokens += len(tokens)
        for req in done:
            self.running.remove(req)
            self._release(req)
            del self.requests[req.rid]
            finished.append((req.rid, "length", req.scheduled_t, req.first_t, req.preemptions, req.generated))
        return tokens, finished

    def stats(self) -> dict[str, float]:
        a = self.alloc
        total = a.get_num_total_pages()
        inuse = a.get_num_inuse_pages()
        return {
            "running": float(len(self.running)),
            "waiting": float(len(self.waiting)),
            "kv_usage": inuse / total if total else 0.0,
            "preemptions": float(self.preemptions),
            "prompt_tokens": float(self.prompt_tokens),
            "generation_tokens": float(self.generation_tokens),
            "total_pages": float(total),
            "free_pages": float(a.get_num_free_pages()),
            "inuse_pages": float(inuse),
            "reserved_pages": float(a.get_num_reserved_pages()),
            "inflight_pages": float(a.get_num_inflight_pages()),
        }
