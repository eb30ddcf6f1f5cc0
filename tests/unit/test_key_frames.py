"""Key frames: which cited frames each rule rests on, on saved real bundles (tests/fixtures/bundles).

Every bundle was captured from a running program (or parsed from a real vLLM server's tool outputs);
the expected key frames are what each rule says it rests on: the blocking call, the GIL acquire, the
first project frame and the Python call that entered it; never libc internals, the interpreter's eval
loop, binding glue or the C++ standard library.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import jsonschema
import pytest
from reportkit import build_report, view_of

from kvdiag.analyze.overall import analyze
from kvdiag.bundle.io import load_bundle
from kvdiag.model.bundle import Bundle
from kvdiag.model.verdict import EvidenceItem, Verdict
from kvdiag.report.html import render_html
from kvdiag.report.json import render_json
from kvdiag.report.markdown import render_markdown
from kvdiag.report.view import format_frame

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"
ALL = sorted(str(p.parent.relative_to(BUNDLES)) for p in BUNDLES.glob("**/bundle.json"))


def load(name: str) -> tuple[Bundle, Verdict]:
    bundle = load_bundle(BUNDLES / name)[0]
    return bundle, analyze(bundle)


def keys(item: EvidenceItem) -> list[str]:
    assert item.key_frames is not None
    return [item.frames[i] for i in item.key_frames]


# (bundle, verdict kind, key frames of each evidence item in order)
EXPECTED: list[tuple[str, str, list[list[str]]]] = [
    ("vllm_two_engine_stock", "gil_cycle", [
        ["pthread_cond_wait@@GLIBC_2.3.2 (pthread_cond_wait.c:618)",
         "kvdiag::stock::PageAllocator::alloc_page() (stock_allocator.cpp:95)", "take_null_block (__init__.py:143)"],
        ["PyGILState_Ensure (pystate.c:1712)", "kvdiag::stock::PageAllocator::map_pages (stock_allocator.cpp:283)"]]),
    ("gil_cycle", "gil_cycle", [
        ["pthread_cond_wait@@GLIBC_2.3.2 (pthread_cond_wait.c:618)", "alloc_page (gil_cycle.c:66)",
         "<module> (gil_cycle.py:42)"],
        ["PyGILState_Ensure (pystate.c:1712)", "map_pages (gil_cycle.c:26)"]]),
    ("gil_cycle_stripped", "gil_cycle", [
        ["pthread_cond_wait@@GLIBC_2.3.2 (pthread_cond_wait.c:618)", "alloc_page (gil_cycle.c:66)",
         "<module> (gil_cycle.py:42)"],
        ["PyGILState_Ensure (libpython3.11.so.1.0)", "map_pages (gil_cycle.c:26)"]]),
    ("corpus/gil_cycle_pybind11", "gil_cycle", [
        ["pthread_cond_wait@@GLIBC_2.3.2 (pthread_cond_wait.c:618)", "PagePool::alloc_page(int) (kvpool_pb.cpp:33)",
         "<module> (gil_cycle_ext.py:27)"],
        ["take_gil (ceval_gil.h:231)", "PagePool::map_pages() (kvpool_pb.cpp:39)"]]),
    ("corpus/gil_cycle_nanobind", "gil_cycle", [
        ["pthread_cond_wait@@GLIBC_2.3.2 (pthread_cond_wait.c:618)", "PagePool::alloc_page(int) (kvpool_nb.cpp:33)",
         "<module> (gil_cycle_ext.py:27)"],
        ["PyGILState_Ensure (pystate.c:1712)", "PagePool::map_pages() (kvpool_nb.cpp:39)"]]),
    # The other side is a ctypes callback: no project frame yet, the callback trampoline wants the GIL.
    ("corpus/gil_cycle_ctypes_callback", "gil_cycle", [
        ["__pthread_clockjoin_ex (pthread_join_common.c:102)", "<module> (gil_cycle_callback.py:35)"],
        ["PyGILState_Ensure (pystate.c:1712)", "_CallPythonObject (callbacks.c:162)"]]),
    ("corpus/gil_held_read_queue", "gil_held_blocked", [
        ["read (read.c:24)", "hold_gil_and_read (gil_held.c:38)"],
        ["take_gil (ceval_gil.h:231)", "ticker (gil_held.py:33)"]]),
    ("lock_inversion", "lock_order_inversion", [
        ["__pthread_mutex_lock@GLIBC_2.2.5 (pthread_mutex_lock.c:93)", "take (lock_inversion.py:25)"]] * 2),
    ("corpus/lock_inversion_py2", "lock_order_inversion", [
        ["lock_PyThread_acquire_lock (_threadmodule.c:179)", "refresh (lock_inversion_py.py:31)"]] * 2),
    ("corpus/ipc_read_tcp", "blocked_ipc_read", [["__recv (recv.c:28)", "<module> (ipc_read_more.py:57)"]]),
    # The project frame lies under multiprocessing's own frames: the citation reaches down to it.
    ("corpus/ipc_read_mpqueue", "blocked_ipc_read", [["read (read.c:26)", "<module> (ipc_read_more.py:64)"]]),
    ("corpus/ipc_read_asyncio", "blocked_ipc_read", [
        ["epoll_wait (epoll_wait.c:30)", "<module> (ipc_read_more.py:75)"]]),
    ("lost_wakeup", "lost_wakeup", [
        ["pthread_cond_wait@@GLIBC_2.3.2 (pthread_cond_wait.c:618)", "consumer (lost_wakeup.py:23)"],
        ["join (threading.py:1119)"]]),
    ("corpus/lost_wakeup_py", "lost_wakeup", [
        ["wait (threading.py:327)", "consumer (lost_wakeup_py.py:25)"], ["join (threading.py:1119)"]]),
]


@pytest.mark.parametrize(("name", "kind", "expected"), EXPECTED, ids=[e[0] for e in EXPECTED])
def test_each_rule_states_its_key_frames(name: str, kind: str, expected: list[list[str]]) -> None:
    _, verdict = load(name)
    assert verdict.kind.value == kind, verdict.summary
    assert [keys(item) for item in verdict.evidence] == expected


def test_gil_cycle_holder_rests_on_the_condvar_wait_and_alloc_page_not_on_libc_or_the_eval_loop() -> None:
    _, verdict = load("gil_cycle_no_pystack")    # no Python frames: the interpreter's C frames fill the citation
    holder = verdict.evidence[0]
    assert any(f.startswith("_PyEval_EvalFrameDefault") for f in holder.frames)
    assert keys(holder) == ["___pthread_cond_wait (pthread_cond_wait.c:618)", "alloc_page (gil_cycle.c:66)"]


INTERNAL = re.compile(r"^(__pthread_cond_wait_common|__GI___lll_lock_wait|lll_mutex_lock|_?PyEval_|ffi_call|"
                      r"_call_function_pointer|_ctypes_callproc|PyCFuncPtr_call|start_thread|_*clone|"
                      r"[\w ]*std::|nanobind::detail|pybind11::detail|cfunction_call|\?\?)")


@pytest.mark.parametrize("name", ALL)
def test_key_frames_are_few_valid_and_never_internals(name: str) -> None:
    _, verdict = load(name)
    for item in verdict.evidence:
        assert item.key_frames is not None
        assert item.key_frames == sorted(set(item.key_frames))
        assert all(0 <= i < len(item.frames) for i in item.key_frames)
        assert len(item.key_frames) <= 3
        assert not [k for k in keys(item) if INTERNAL.match(k)], (item.role, keys(item))
        if item.frames and verdict.kind.value not in ("stopped", "traced"):   # those rest on the process state
            assert item.key_frames, (item.role, item.frames)


# Key frames that are the blocking call or the GIL acquire, not the application's own code.
SYSTEM_KEY = re.compile(r"^(_[^ ]* \((?![^)]*\.py:)|pthread_|lock_PyThread|rlock_acquire|read |recv|epoll_wait|"
                        r"take_gil|PyGILState|PyEval|\w+ \(threading\.py)")


def _project_name(text: str) -> str:
    """How a summary names a cited project frame: ``PageAllocator::alloc_page`` for
    ``kvdiag::stock::PageAllocator::alloc_page() (stock_allocator.cpp:95)``."""
    if text.startswith("<"):
        return text
    name = re.sub(r"\(.*$", "", text.split(" (")[0])
    return "::".join(name.split("::")[-2:])


@pytest.mark.parametrize("name", ALL)
def test_summary_names_the_first_project_frame_not_libc_stl_or_stdlib(name: str) -> None:
    _, verdict = load(name)
    if not verdict.kind.is_hang or not verdict.evidence or verdict.kind.value in ("stopped", "traced"):
        return
    first = verdict.evidence[0]
    project = [k for k in keys(first) if not INTERNAL.match(k) and not SYSTEM_KEY.match(k)]
    if not project:
        return    # nothing of the application's own on the stack (a proc-only capture)
    assert _project_name(project[0]) in verdict.summary, verdict.summary
    for word in ("std::", "__pthread", "_PyEval", "ffi_call", "(threading.py", "connection.py"):
        assert word not in verdict.summary.split("; mechanism")[0], verdict.summary


class _Frames(HTMLParser):
    """The <li> frames of an HTML section, with their classes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.items: list[tuple[str, str]] = []
        self._cls: str | None = None
        self._text: list[str] = []
        self._src = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "li":
            self._cls = dict(attrs).get("class") or ""
            self._text = []
            self._src = False
        elif tag == "br":
            self._src = True      # the frame's source line follows

    def handle_endtag(self, tag: str) -> None:
        if tag == "li" and self._cls is not None:
            self.items.append((self._cls, "".join(self._text)))
            self._cls = None

    def handle_data(self, data: str) -> None:
        if self._cls is not None and not self._src:
            self._text.append(data)


def _section(page: str, start: str, end: str) -> list[tuple[str, str]]:
    parser = _Frames()
    parser.feed(page[page.index(start):page.index(end)])
    return parser.items


@pytest.mark.parametrize("name", ["vllm_two_engine_stock", "gil_cycle", "corpus/lock_inversion_py2",
                                  "corpus/ipc_read_mpqueue"])
def test_html_highlights_exactly_the_key_frames(name: str) -> None:
    bundle, verdict = load(name)
    report = build_report(bundle, verdict, command="analyze", exit_code=10)
    page = render_html(view_of(report, bundle))
    want = [k for item in verdict.evidence for k in keys(item)]
    evidence = _section(page, '<section id="evidence">', '<section id="engines">')
    assert [text for cls, text in evidence if cls == "key"] == want
    assert len([1 for cls, _ in evidence if cls == "ctx"]) == sum(len(i.frames) for i in verdict.evidence) - len(want)
    # In the full per-thread stacks: one highlighted frame per key frame, and it is that frame.
    stacks = _section(page, 'id="processes"', '<section id="raw"')
    lit = [text for cls, text in stacks if "key" in cls.split()]
    assert len(lit) == len(want)
    by_thread = {(p.pid, t.tid): t for p in bundle.processes for t in p.threads}
    expected_lit = []
    for item in verdict.evidence:
        frames = by_thread[(item.pid, item.tid)].frames
        for k in keys(item):
            name_part = k.split(" (")[0]
            expected_lit.append(next(format_frame(f) for f in frames if f.name.startswith(name_part.rstrip("()"))
                                     or name_part.startswith(f.name)))
    assert sorted(lit) == sorted(expected_lit)


def test_markdown_marks_the_key_frames() -> None:
    bundle, verdict = load("vllm_two_engine_stock")
    md = render_markdown(view_of(build_report(bundle, verdict, command="analyze", exit_code=10), bundle))
    marked = [line[2:] for line in md.splitlines() if line.startswith("→ ")]
    evidence_keys = [k for item in verdict.evidence for k in keys(item)]
    assert marked[:len(evidence_keys)] == evidence_keys
    assert "  __pthread_cond_wait_common (pthread_cond_wait.c:503)" in md.splitlines()


def test_report_json_carries_key_frames_and_validates() -> None:
    bundle, verdict = load("vllm_two_engine_stock")
    data = json.loads(render_json(view_of(build_report(bundle, verdict, command="analyze", exit_code=10))))
    schema = json.loads((Path(__file__).resolve().parents[2] / "schema" / "report.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(data)
    assert data["schema_version"] == "1"
    holder = data["verdict"]["evidence"][0]
    assert [holder["frames"][i] for i in holder["key_frames"]] == EXPECTED[0][2][0]
