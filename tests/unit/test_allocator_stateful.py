"""Random alloc/free/trigger/resize/trim sequences through the reference twin and both native
allocators; after every step (with the native workers synced idle) their observable state must be
identical: the same page ids, list sizes, errors and mapped pages."""

from __future__ import annotations

import os
import uuid
from typing import Any

import kvdiag._native  # noqa: F401  (built by the package: a missing build fails, never skips)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvdiag.allocator import make_allocator
from kvdiag.allocator.protocol import PageAllocator

PAGE = 64 * 1024
LAYERS = 2
KINDS = ("reference", "stock", "fixed")


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    """Run one call; map errors to comparable tags."""
    try:
        return ("ok", fn(*args))
    except ValueError as exc:
        return ("ValueError", str(exc).split(":")[0])
    except RuntimeError as exc:
        return ("RuntimeError", str(exc).split(":")[0])


class AllocatorTwins(RuleBasedStateMachine):
    """One reference, one stock and one fixed allocator driven in lock step."""

    def __init__(self) -> None:
        super().__init__()
        self.allocs: dict[str, PageAllocator] = {}
        self.held: list[int] = []
        self.pages = 0

    @initialize(
        pages=st.integers(min_value=1, max_value=12),
        min_res=st.integers(min_value=0, max_value=5),
        extra=st.integers(min_value=0, max_value=4),
        prealloc=st.booleans(),
        start=st.booleans(),
        contiguous=st.booleans(),
    )
    def build(self, pages: int, min_res: int, extra: int, prealloc: bool, start: bool, contiguous: bool) -> None:
        self.pages = pages
        tag = uuid.uuid4().hex[:8]
        for kind in KINDS:
            self.allocs[kind] = make_allocator(
                kind,
                num_layers=LAYERS,
                mem_size_per_layer=pages * PAGE,
                page_size=PAGE,
                min_reserved_pages=min_res,
                max_reserved_pages=min_res + extra,
                enable_prealloc=prealloc,
                contiguous_layout=contiguous,
                device_name=f"kvdiag-hyp-{os.getpid()}-{tag}-{kind}",
                print_banner=False,
            )
        if start:
            self.each("start_prealloc_thread")

    def each(self, method: str, *args: Any) -> tuple[str, Any]:
        results = {}
        for kind, alloc in self.allocs.items():
            results[kind] = _outcome(getattr(alloc, method), *args)
            if kind != "reference":
                assert alloc.wait_prealloc_idle(10.0), f"{kind} worker did not go idle after {method}"
        assert results["stock"] == results["reference"], (method, args, results)
        assert results["fixed"] == results["reference"], (method, args, results)
        return results["reference"]

    @rule()
    def alloc(self) -> None:
        status, page = self.each("alloc_page")
        if status == "ok":
            assert page not in self.held
            self.held.append(page)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def free_one(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held))
        self.held.remove(page)
        assert self.each("free_page", page)[0] == "ok"

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        batch = data.draw(st.lists(st.sampled_from(self.held), unique=True, min_size=1))
        for page in batch:
            self.held.remove(page)
        assert self.each("free_pages", batch)[0] == "ok"

    @rule(page=st.integers(min_value=-2, max_value=14))
    def free_bad(self, page: int) -> None:
        if page in self.held:
            return
        assert self.each("free_page", page)[0] == "ValueError"

    @rule()
    def trigger(self) -> None:
        self.each("trigger_preallocation")

    @rule(target_pages=st.integers(min_value=0, max_value=14))
    def resize(self, target_pages: int) -> None:
        self.each("resize", target_pages * PAGE)

    @rule()
    def trim(self) -> None:
        self.each("trim")

    @rule()
    def start(self) -> None:
        self.each("start_prealloc_thread")

    @rule()
    def stop(self) -> None:
        self.each("stop_prealloc_thread")

    @invariant()
    def same_state(self) -> None:
        if not self.allocs:
            return
        getters = ("get_num_free_pages", "get_num_inuse_pages", "get_num_total_pages", "get_num_reserved_pages",
                   "get_num_inflight_pages", "get_num_mapped_pages", "get_avail_physical_pages")
        snap = {kind: tuple(getattr(a, g)() for g in getters) for kind, a in self.allocs.items()}
        assert snap["stock"] == snap["reference"], snap
        assert snap["fixed"] == snap["reference"], snap
        ref = snap["reference"]
        assert ref[1] == len(self.held)
        assert ref[4] == 0

    def teardown(self) -> None:
        for alloc in self.allocs.values():
            alloc.stop_prealloc_thread()
        self.allocs.clear()


AllocatorTwins.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorTwins = AllocatorTwins.TestCase
