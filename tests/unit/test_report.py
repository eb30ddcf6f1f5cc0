"""Report stage: report.json against its schema, HTML/Markdown/terminal rendering, atomic partial writes, CLI.

Renderers are pure, so bundles here are built from the model types directly.
"""

from __future__ import annotations

import html
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import jsonschema
import pytest
from reportkit import build_report, view_of, write_outputs
from rich.console import Console

from kvdiag.bundle.io import save_bundle
from kvdiag.cli.main import main
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import Frame, ProcessEvidence, ThreadEvidence, ToolRun
from kvdiag.model.kinds import Confidence, EnginePhase, GilState, ProcessRole, ThreadState, VerdictKind
from kvdiag.model.report import Report
from kvdiag.model.run import BannerInfo, EngineRecord, Finding, SoakStats, TimelineEvent
from kvdiag.model.verdict import ABComparison, ABEngine, ABSide, EvidenceItem, Verdict
from kvdiag.model.waits import FrameRef
from kvdiag.report.html import RAW_FILE_CAP, cycle_diagram, render_html, script_json
from kvdiag.report.json import render_json
from kvdiag.report.markdown import render_markdown
from kvdiag.report.terminal import render_terminal

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schema" / "report.schema.json"


def ab_carrying(text: str) -> ABComparison:
    """An A/B comparison whose summaries, engine name and health lines are ``text`` (a payload to render)."""
    side = ABSide(verdict=VerdictKind.GIL_CYCLE, summary=text, exit_code=10, bundle="../stock/bundle",
                  report="stock/report.html", engines={text: ABEngine(phase=EnginePhase.STALLED, health=text)})
    return ABComparison(stock=side, fixed=side.model_copy(update={"verdict": VerdictKind.HEALTHY, "exit_code": 0,
                                                                  "bundle": "../fixed/bundle"}), separated=True)
BANNER_RAW = ("Init C++ PageAllocator: num_layers=28, mem_size_per_layer=11MB, total_mem_size=667MB, page_size=2MB, "
              "world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1, enable_prealloc=1, num_kv_buffers=2, "
              "group_id=0, min_reserved_pages=5, max_reserved_pages=5")


def _banner() -> BannerInfo:
    return BannerInfo(num_layers=28, mem_size_per_layer_mb=11, total_mem_size_mb=667, page_size_mb=2, world_size=1,
                      pp_rank=0, async_sched=True, contiguous_layout=True, enable_prealloc=True, num_kv_buffers=2,
                      group_id=0, min_reserved_pages=5, max_reserved_pages=5, raw=BANNER_RAW, line_no=7)


def seed_bundle(bundle_dir: Path | None = None) -> tuple[Bundle, Verdict, dict[str, Verdict]]:
    """The seed's hang as a capture would record it: engine 2's EngineCore in a GIL cycle."""
    holder = [Frame(name="futex_wait", library="libc.so.6"),
              Frame(name="std::condition_variable::wait", library="libstdc++.so.6"),
              Frame(name="kvcached::PageAllocator::alloc_page", file="csrc/page_allocator.cpp", line=212),
              Frame(name="alloc_kv", kind="python", file="kvdiag/sim/engine.py", line=88,
                    source="page = alloc.alloc_page()")]
    worker = [Frame(name="take_gil", file="Python/ceval_gil.c", line=300, library="libpython3.11.so"),
              Frame(name="PyEval_RestoreThread", library="libpython3.11.so"),
              Frame(name="kvcached::PageAllocator::map_pages", file="csrc/page_allocator.cpp", line=401),
              Frame(name="kvcached::PageAllocator::prealloc_worker", file="csrc/page_allocator.cpp", line=350)]
    if bundle_dir is not None:
        (bundle_dir / "raw" / "eng2").mkdir(parents=True, exist_ok=True)
        (bundle_dir / "logs").mkdir(parents=True, exist_ok=True)
        (bundle_dir / "raw/eng2/py-spy-200.txt").write_text('Thread 200 (idle): "MainThread"\n    alloc_page\n')
        (bundle_dir / "logs/eng2.log").write_text(f"\x1b[32mINFO\x1b[0m loading\n{BANNER_RAW}\n")
    bundle = Bundle(
        kvdiag_version="0.1.0", command="repro two-engine", created_at="2025-01-01T00:00:00+00:00",
        host={"machine": "box64", "python": "3.11.7"}, scenario_path="two-engine", stall_window_s=5.0,
        engines=[
            EngineRecord(name="eng1", allocator="stock", phase=EnginePhase.SERVING, healthy=True,
                         pids={"api_server": 100, "engine_core": 101}, startup_s=3.2,
                         last_log_line="INFO:     Application startup complete.", log_path="logs/eng1.log"),
            EngineRecord(name="eng2", allocator="stock", phase=EnginePhase.STALLED, banners=[_banner()],
                         pids={"api_server": 199, "engine_core": 200}, last_log_line=BANNER_RAW,
                         log_tail=["loading", BANNER_RAW], log_path="logs/eng2.log"),
        ],
        processes=[ProcessEvidence(
            pid=200, ppid=199, comm="VLLM::EngineCor", cmdline=["python", "-m", "kvdiag.sim"],
            role=ProcessRole.ENGINE_CORE, engine="eng2", state=ThreadState.SLEEPING, wchan="futex_wait_queue",
            tools=[ToolRun(tool="py-spy", ok=True, duration_s=0.2, raw_path="raw/eng2/py-spy-200.txt"),
                   ToolRun(tool="gdb", ok=False, error="gdb not installed")],
            threads=[ThreadEvidence(tid=200, name="MainThread", state=ThreadState.SLEEPING, gil=GilState.HOLDS,
                                    wchan="futex_wait_queue", kernel_stack=["futex_wait_queue+0x60"], frames=holder),
                     ThreadEvidence(tid=201, name="prealloc_worker", gil=GilState.WAITING, in_gil_struct=True,
                                    frames=worker),
                     ThreadEvidence(tid=202, name="idle", frames=[Frame(name="poll", library="libc.so.6")])])],
        timeline=[TimelineEvent(t=0.0, event="launch", engine="eng1"),
                  TimelineEvent(t=3.2, event="ready", engine="eng1"),
                  TimelineEvent(t=5.1, event="banner", engine="eng2", detail="enable_prealloc=1"),
                  TimelineEvent(t=5.2, event="stall onset (last progress)", engine="eng2"),
                  TimelineEvent(t=10.3, event="capture finished")],
        findings=[Finding(kind="banner_risk", message="pool is 5 page(s) per layer", engine="eng2")],
    )
    verdict = Verdict(
        kind=VerdictKind.GIL_CYCLE, confidence=Confidence.HIGH, engine="eng2",
        summary="eng2: alloc_page holds the GIL in a condition wait; the prealloc worker waits for the GIL",
        evidence=[EvidenceItem(pid=200, tid=200, role="alloc_page caller (holds GIL)", engine="eng2",
                               frames=["std::condition_variable::wait",
                                       "kvcached::PageAllocator::alloc_page (csrc/page_allocator.cpp:212)"]),
                  EvidenceItem(pid=200, tid=201, role="prealloc worker (waits for GIL)", engine="eng2",
                               frames=["take_gil", "PageAllocator::map_pages"])],
        cycle=["tid 200 alloc_page (holds GIL)", "tid 201 prealloc_worker", "GIL"],
    )
    return bundle, verdict, {"eng1": Verdict(kind=VerdictKind.HEALTHY, summary="serving"), "eng2": verdict}


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


class _Dom(HTMLParser):
    """Collects element names, attributes and text, the way a browser's tokenizer would see them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        (self.scripts if self._in_script else self.text).append(data)


def _dom(page: str) -> _Dom:
    dom = _Dom()
    dom.feed(page)
    return dom


# ---------------------------------------------------------------- report.json

def test_report_json_validates_and_round_trips(tmp_path: Path, validator: jsonschema.Draft202012Validator) -> None:
    bundle, verdict, by_engine = seed_bundle(tmp_path / "bundle")
    paths = write_outputs(tmp_path, bundle, verdict, command="repro two-engine", exit_code=10,
                          verdicts_by_engine=by_engine)
    data = json.loads(paths["report.json"].read_text())
    validator.validate(data)
    assert data["schema_version"] == "1" and data["command"] == "repro two-engine" and data["exit_code"] == 10
    assert data["verdict"]["kind"] == "gil_cycle"
    assert data["verdict"]["evidence"][0] == {"pid": 200, "tid": 200, "role": "alloc_page caller (holds GIL)",
                                              "engine": "eng2", "frames": verdict.evidence[0].frames,
                                              "key_frames": None, "node": None,
                                              "refs": []}   # hand-made evidence: no key frames, no references
    eng2 = data["engines"][1]
    assert eng2["name"] == "eng2" and eng2["phase"] == "stalled" and eng2["verdict"] == "gil_cycle"
    assert eng2["pids"] == {"api_server": 199, "engine_core": 200}
    assert eng2["banner"]["num_layers"] == 28 and eng2["banner_risk"]["risky"] is True
    assert eng2["banner_risk"]["pages_per_layer"] == 5
    assert data["engines"][0]["banner"] is None and data["engines"][0]["banner_risk"] is None
    assert data["bundle_path"] == "bundle"
    assert [e["t"] for e in data["timeline"]] == sorted(e["t"] for e in data["timeline"])
    # Round trip: the file parses back into the same Report.
    again = Report.model_validate(data)
    assert again == build_report(bundle, verdict, command="repro two-engine", exit_code=10,
                                 verdicts_by_engine=by_engine, bundle_path="bundle")
    assert json.loads(render_json(view_of(again))) == data


def test_schema_enums_match_the_model() -> None:
    defs = json.loads(SCHEMA_PATH.read_text())["$defs"]
    assert set(defs["verdict_kind"]["enum"]) == {k.value for k in VerdictKind}
    assert set(defs["confidence"]["enum"]) == {c.value for c in Confidence}
    assert set(defs["phase"]["enum"]) == {p.value for p in EnginePhase}
    required = set(json.loads(SCHEMA_PATH.read_text())["required"])
    assert required <= set(Report.model_fields)


def test_partial_interrupted_run_still_writes_a_readable_report(
        tmp_path: Path, validator: jsonschema.Draft202012Validator) -> None:
    bundle = Bundle(command="repro two-engine", interrupted=True,
                    engines=[EngineRecord(name="eng1", phase=EnginePhase.LOADING)])
    verdict = Verdict(kind=VerdictKind.UNKNOWN, summary="run interrupted: Ctrl-C", confidence=Confidence.LOW)
    (tmp_path / "report.json").write_text("{ half-written garb")  # a stale file is replaced whole
    paths = write_outputs(tmp_path, bundle, verdict, command="repro two-engine", exit_code=130)
    data = json.loads(paths["report.json"].read_text())
    validator.validate(data)
    assert data["interrupted"] is True and data["exit_code"] == 130 and data["bundle_path"] is None
    assert not any(f["kind"] == "report_render_failed" for f in data["findings"])
    page = paths["report.html"].read_text()
    assert "This run was interrupted" in page and "No process was captured" in page
    assert "run interrupted: Ctrl-C" in paths["report.md"].read_text()
    # Atomic writes leave no temporaries behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.json", "report.md"]


def test_empty_bundle_healthy(validator: jsonschema.Draft202012Validator) -> None:
    report = build_report(Bundle(), Verdict(kind=VerdictKind.HEALTHY, summary="ok"), command="capture", exit_code=0)
    validator.validate(json.loads(render_json(view_of(report))))
    page = render_html(view_of(report))
    assert "Rendered without the bundle" in page and 'id="cycle"' not in page
    assert render_markdown(view_of(report)).startswith("### kvdiag: `healthy`")


# ---------------------------------------------------------------- HTML

def test_html_is_self_contained_and_embeds_the_report(tmp_path: Path) -> None:
    bundle, verdict, by_engine = seed_bundle(tmp_path / "bundle")
    paths = write_outputs(tmp_path, bundle, verdict, command="repro two-engine", exit_code=10,
                          verdicts_by_engine=by_engine)
    page = paths["report.html"].read_text()
    dom = _dom(page)
    for tag, attrs in dom.tags:
        assert tag not in ("link", "iframe", "object", "embed", "img", "base"), tag
        for name in ("src", "href", "action"):
            value = attrs.get(name)
            if tag == "a" and name == "href" and value and not value.startswith("#"):
                # A link to a file of the run's bundle (navigation, not a load): relative, no scheme.
                assert value.startswith("bundle/") and ":" not in value and "//" not in value, value
                continue
            assert value is None or value.startswith("#") or value.startswith("url(#"), (tag, name, value)
    csp = [a["content"] for t, a in dom.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp and "default-src 'none'" in str(csp[0])
    # Exactly our two script blocks; the JSON one parses back to report.json.
    scripts = [a for t, a in dom.tags if t == "script"]
    assert len(scripts) == 2 and scripts[0].get("type") == "application/json"
    embedded = re.search(r'<script type="application/json" id="kvdiag-report">(.*?)</script>', page, re.S)
    assert embedded is not None
    assert json.loads(embedded.group(1)) == json.loads(paths["report.json"].read_text())
    text = " ".join(dom.text)
    # Verdict first: the kind appears before any other section heading.
    assert text.index("gil_cycle") < text.index("Wait-for cycle") < text.index("Evidence")
    # Raw outputs and the log (ANSI codes stripped) are embedded; the missing log is noted.
    assert 'Thread 200 (idle): "MainThread"' in text and "\x1b[" not in page
    assert "file not in the bundle" in text


def test_html_highlights_only_the_key_frames_and_opens_cited_threads(tmp_path: Path) -> None:
    bundle, verdict, by_engine = seed_bundle(tmp_path / "bundle")
    verdict.evidence[0].key_frames = [1]          # alloc_page, not the STL condvar wait above it
    verdict.evidence[1].key_frames = [0, 1]       # take_gil, map_pages
    verdict.evidence[0].refs = [FrameRef(pid=200, tid=200, index=i) for i in (1, 2)]
    verdict.evidence[1].refs = [FrameRef(pid=200, tid=201, index=i) for i in (0, 2)]
    report = build_report(bundle, verdict, command="repro two-engine", exit_code=10, verdicts_by_engine=by_engine)
    page = render_html(view_of(report, bundle, tmp_path / "bundle"))
    stacks = page[page.index('id="processes"'):]
    keyed = re.findall(r'<li class="(?:native|python) key">([^<]*)', stacks)
    assert keyed == ["kvcached::PageAllocator::alloc_page (csrc/page_allocator.cpp:212)",
                     "take_gil (Python/ceval_gil.c:300) [libpython3.11.so]",
                     "kvcached::PageAllocator::map_pages (csrc/page_allocator.cpp:401)"]
    evidence = page[page.index('<section id="evidence">'):page.index('<section id="engines">')]
    assert re.findall(r'<li class="key">([^<]*)', evidence) == [
        "kvcached::PageAllocator::alloc_page (csrc/page_allocator.cpp:212)", "take_gil", "PageAllocator::map_pages"]
    assert re.findall(r'<li class="ctx">([^<]*)', evidence) == ["std::condition_variable::wait"]
    threads = re.findall(r'<details class="thread( cited)?"( open)?>\s*<summary><b>tid (\d+)', page)
    assert [(c, o, t) for c, o, t in threads] == [(" cited", " open", "200"), (" cited", " open", "201"),
                                                  ("", "", "202")]


def test_html_of_a_report_without_key_frames_highlights_no_frame(tmp_path: Path) -> None:
    """A report written before key frames were recorded still renders: its threads are cited, no frame
    is singled out (the renderer does not guess which ones the rule rested on)."""
    bundle, verdict, by_engine = seed_bundle(tmp_path / "bundle")
    data = json.loads(render_json(view_of(build_report(bundle, verdict, command="repro two-engine", exit_code=10,
                                                       verdicts_by_engine=by_engine))))
    for item in data["verdict"]["evidence"]:
        item.pop("key_frames", None)
    old = Report.model_validate(data)
    assert old.verdict.evidence[0].key_frames is None
    page = render_html(view_of(old, bundle, tmp_path / "bundle"))
    assert not re.findall(r'<li class="[^"]*\b(key|ctx)\b', page)
    assert "kvcached::PageAllocator::alloc_page (csrc/page_allocator.cpp:212)" in page
    assert re.findall(r'<details class="thread cited" open>', page)


def test_stacks_highlight_the_referenced_frame_not_one_with_the_same_text(tmp_path: Path) -> None:
    """A key frame is found by its reference (pid, tid, index): a line whose text names another frame, or
    no frame at all, still lights the frame it refers to and only that one."""
    bundle, verdict, by_engine = seed_bundle(tmp_path / "bundle")
    item = verdict.evidence[1]
    item.frames = ["kvcached::PageAllocator::prealloc_worker (csrc/page_allocator.cpp:350)", "a renamed frame"]
    item.refs = [FrameRef(pid=200, tid=201, index=i) for i in (2, 3)]
    item.key_frames = [0]         # the line's text is the worker's name; the frame it refers to is map_pages
    verdict.evidence = [item]
    page = render_html(view_of(build_report(bundle, verdict, command="c", exit_code=10), bundle))
    stacks = page[page.index('id="processes"'):]
    assert re.findall(r'<li class="(?:native|python) key">([^<]*)', stacks) == [
        "kvcached::PageAllocator::map_pages (csrc/page_allocator.cpp:401)"]
    md = render_markdown(view_of(build_report(bundle, verdict, command="c", exit_code=10), bundle))
    assert "→ kvcached::PageAllocator::map_pages (csrc/page_allocator.cpp:401)" in md.splitlines()


def test_cycle_diagram_shapes() -> None:
    seed = cycle_diagram(["tid 1 alloc_page (holds GIL)", "tid 2 prealloc_worker", "GIL"])
    assert seed is not None and len(seed.nodes) == 3 and len(seed.edges) == 3
    assert [e.label for e in seed.edges] == ["waits for", "waits for", "held by"]
    assert [n.kind for n in seed.nodes] == ["thread", "thread", "gil"]
    for n in seed.nodes:  # every node inside the drawing
        assert 0 <= n.x and n.x + n.w <= seed.width and 0 <= n.y and n.y + n.h <= seed.height
    closed = cycle_diagram(["A", "B", "A"])
    assert closed is not None and len(closed.nodes) == 2 and len(closed.edges) == 2
    assert closed.edges[0].d != closed.edges[1].d  # A→B and B→A bend apart
    self_loop = cycle_diagram(["tid 9 waits on its own lock"])
    assert self_loop is not None and len(self_loop.edges) == 1
    assert cycle_diagram([]) is None


def test_script_json_cannot_close_the_script_block() -> None:
    data = {"line": "</script><script>alert(1)</script><!-- \u2028\u2029 & done"}
    out = str(script_json(data))
    assert "</" not in out and "<!--" not in out and "\u2028" not in out and "\u2029" not in out and "&" not in out
    assert json.loads(out) == data


def test_html_escapes_injected_markup_everywhere(tmp_path: Path) -> None:
    xss = '<script>window.__pwned=1</script><img src=x onerror="document.title=\'pwned\'">'
    bundle, verdict, _ = seed_bundle(tmp_path / "bundle")
    bundle.engines[1].name = f"eng2{xss}"
    bundle.engines[1].last_log_line = xss
    bundle.engines[1].log_tail = [xss]
    bundle.processes[0].cmdline = ["python", xss]
    bundle.processes[0].threads[0].name = xss
    bundle.processes[0].threads[0].frames[0].name = xss
    bundle.timeline.append(TimelineEvent(t=6.0, event=xss, engine=bundle.engines[1].name, detail=xss))
    bundle.findings.append(Finding(kind=xss, message=xss))
    (tmp_path / "bundle/raw/eng2/py-spy-200.txt").write_text(xss)
    verdict.summary = xss
    verdict.cycle = [xss, "GIL"]
    verdict.evidence[0].role = xss
    report = build_report(bundle, verdict, command=xss, exit_code=10, verdicts_by_engine={xss: verdict},
                          ab=ab_carrying(xss), bundle_path=xss)
    page = render_html(view_of(report, bundle, tmp_path / "bundle"))
    dom = _dom(page)
    assert [t for t, _ in dom.tags if t in ("img", "script")] == ["script", "script"]
    assert not any(name.startswith("on") for _, attrs in dom.tags for name in attrs)
    text = "".join(dom.text)
    assert text.count(xss) >= 10  # shown as text: summary, cycle, names, log lines, raw output, ...
    # Markdown: GitHub renders inline HTML, so outside code blocks and spans the payload must be inert.
    md = render_markdown(view_of(report, bundle))
    prose = re.sub(r"(`{3,})[^\n]*\n.*?\n\1", "", md, flags=re.S)
    prose = re.sub(r"(`+).*?\1", "", prose)
    assert "<script" not in prose and "<img" not in prose and "&lt;script&gt;" in prose


# ---------------------------------------------------------------- Markdown and terminal

def test_markdown_is_issue_ready(tmp_path: Path) -> None:
    bundle, verdict, by_engine = seed_bundle()
    bundle.engines[1].last_log_line = "a | b <pad>"
    verdict.evidence[1].frames.append("weird ``` frame")
    report = build_report(bundle, verdict, command="repro two-engine", exit_code=10, verdicts_by_engine=by_engine)
    md = render_markdown(view_of(report, bundle))
    assert md.startswith("### kvdiag: `gil_cycle` (high confidence)")
    assert "```text\nstd::condition_variable::wait\nkvcached::PageAllocator::alloc_page" in md
    assert "````text\ntake_gil\nPageAllocator::map_pages\nweird ``` frame\n````" in md  # fence outgrows content
    assert "| eng2 | 0 | 28 | 11 MB | 2 MB | 5 | on | 5/5 | **RISK at start-up** |" in md
    assert "a \\| b &lt;pad&gt;" in md  # table cell stays one cell; no raw HTML
    assert "Stacks of the cited threads" in md and "futex_wait [libc.so.6]" in md
    assert "machine: box64" in md


def test_terminal_summary() -> None:
    bundle, verdict, by_engine = seed_bundle()
    bundle.engines[1].last_log_line = "[bold red]not markup[/bold red]"
    report = build_report(bundle, verdict, command="repro two-engine", exit_code=10, verdicts_by_engine=by_engine)
    buf = io.StringIO()
    con = Console(file=buf, width=160, color_system=None, record=False)
    render_terminal(view_of(report), con, {"report.html": Path("/tmp/x/report.html")})
    out = buf.getvalue()
    assert out.index("gil_cycle") < out.index("pid 200 tid 200") < out.index("\nengines")
    assert "std::condition_variable::wait" in out and "take_gil" in out
    assert "RISK" in out and "[bold red]not markup[/bold red]" in out
    assert "report.html: /tmp/x/report.html" in out


# ---------------------------------------------------------------- secrets in every output file

def test_planted_secrets_reach_no_output_file(tmp_path: Path, validator: jsonschema.Draft202012Validator) -> None:
    secrets = {
        "hf": "hf_" + "PlantedHfToken9" * 3,
        "sk": "sk-" + "PlantedOpenAiKey7" * 2,
        "bearer": "PlantedBearerToken0123456789",
        "urlpass": "PlantedUrlPass42",
        "apikey": "PlantedApiKeyFlag55",
    }
    leak = (f"HF_TOKEN={secrets['hf']} OPENAI_API_KEY={secrets['sk']} "
            f"Authorization: Bearer {secrets['bearer']} https://user:{secrets['urlpass']}@hub.example/x "
            f"--api-key {secrets['apikey']}")
    bundle_dir = tmp_path / "captured" / "bundle"  # inputs live outside the output folder
    bundle, verdict, by_engine = seed_bundle(bundle_dir)
    (bundle_dir / "raw/eng2/py-spy-200.txt").write_text(leak)
    (bundle_dir / "logs/eng2.log").write_text(leak + "\n")
    (bundle_dir / "scenario.yaml").write_text(f"engines:\n  - env: {{HF_TOKEN: {secrets['hf']}}}\n")
    bundle.host.kernel = leak
    bundle.engines[1].name = f"eng2 {secrets['sk']}"
    bundle.engines[1].log_tail = [leak]
    bundle.engines[1].last_log_line = leak
    bundle.engines[1].error = leak
    bundle.processes[0].cmdline = ["vllm", "serve", "m", "--api-key", secrets["apikey"], "--hf-token", secrets["hf"]]
    bundle.processes[0].threads[1].name = leak
    bundle.processes[0].tools[1].error = leak
    bundle.timeline.append(TimelineEvent(t=7.0, event=leak, detail=leak, engine=bundle.engines[1].name))
    bundle.findings.append(Finding(kind="tool_failed", message=leak))
    bundle.soak = SoakStats(requests_sent=3)
    verdict.summary = leak
    verdict.evidence[0].frames.append(leak)
    verdict.cycle = [leak, "GIL"]
    by_engine[bundle.engines[1].name] = verdict
    out_dir = tmp_path / "out"
    write_outputs(out_dir, bundle, verdict, command=f"repro --api-key {secrets['apikey']}", exit_code=10,
                  verdicts_by_engine=by_engine, ab=ab_carrying(leak), bundle_dir=bundle_dir)
    files = [p for p in out_dir.rglob("*") if p.is_file()]
    assert {p.name for p in files} == {"report.json", "report.html", "report.md"}
    for path in files:
        content = path.read_text(encoding="utf-8")
        for label, secret in secrets.items():
            assert secret not in content, f"{label} secret leaked into {path.name}"
        assert "REDACTED" in content
    page = (out_dir / "report.html").read_text()
    assert "scenario.yaml" in page and "HF_TOKEN: REDACTED" in page
    validator.validate(json.loads((out_dir / "report.json").read_text()))  # with soak and ab filled in


def test_a_failing_renderer_still_leaves_a_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  validator: jsonschema.Draft202012Validator) -> None:
    import kvdiag.report as report_pkg

    def broken(*_args: object, **_kwargs: object) -> str:
        raise RuntimeError("template bug <b>")

    monkeypatch.setitem(report_pkg.RENDERERS, "report.html", broken)
    bundle, verdict, _ = seed_bundle(tmp_path / "bundle")
    paths = write_outputs(tmp_path, bundle, verdict, command="repro two-engine", exit_code=10)
    data = json.loads(paths["report.json"].read_text())
    validator.validate(data)
    assert any(f["kind"] == "report_render_failed" and "template bug" in f["message"] for f in data["findings"])
    page = paths["report.html"].read_text()
    assert "gil_cycle" in page and "template bug &lt;b&gt;" in page and "see report.json" in page


# ---------------------------------------------------------------- `kvdiag report BUNDLE`

def test_cli_report_rerenders_a_saved_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              validator: jsonschema.Draft202012Validator) -> None:
    run = tmp_path / "run"
    bundle, _, _ = seed_bundle(run / "bundle")
    save_bundle(bundle, run / "bundle")
    assert main(["report", str(run)]) == 0
    data = json.loads((run / "report.json").read_text())
    validator.validate(data)
    assert data["command"] == "repro two-engine"
    assert "verdict:" in capsys.readouterr().out   # the outcome on stdout, progress on stderr
    page = tmp_path / "elsewhere" / "page.html"
    assert main(["report", str(run / "bundle" / "bundle.json"), "--html", str(page)]) == 0
    assert "kvdiag report:" in page.read_text()
    other = tmp_path / "other"
    assert main(["report", str(run / "bundle"), "--out", str(other)]) == 0
    assert 'Thread 200 (idle): "MainThread"' in html.unescape((other / "report.html").read_text())  # raw files


def test_cli_report_missing_bundle_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "no such file or folder" in err and "Traceback" not in err


def test_raw_outputs_are_capped_and_confined(tmp_path: Path) -> None:
    bundle, verdict, _ = seed_bundle(tmp_path / "bundle")
    (tmp_path / "bundle/raw/eng2/py-spy-200.txt").write_text("A" * (RAW_FILE_CAP * 3) + "TAILMARK")
    (tmp_path / "outside.txt").write_text("OUTSIDE-CONTENT")
    bundle.processes[0].tools.append(ToolRun(tool="proc", ok=True, raw_path="../outside.txt"))
    report = build_report(bundle, verdict, command="c", exit_code=10)
    page = render_html(view_of(report, bundle, tmp_path / "bundle"))
    assert "TAILMARK" in page and "bytes omitted" in page and page.count("A" * 1000) < RAW_FILE_CAP // 1000 + 2
    assert "OUTSIDE-CONTENT" not in page and "outside the bundle folder" in page
