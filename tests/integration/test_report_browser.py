"""report.html in a real browser: injected markup shows as text and never runs.

Script/handler payloads are planted in the places a hostile or unlucky
engine controls (log lines, thread names, command lines, model and engine
names, raw tool output, the verdict text). Headless Chromium loads the page
and dumps the DOM after scripts ran; the page's own script marks <html> with
data-kvdiag-js="ok" (positive control: scripts do run in this browser), and
every payload would mark it data-pwned or change the title and log a console
marker if it ran.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvdiag.analyze.engines import diagnosis_of
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import Frame, ProcessEvidence, ThreadEvidence, ToolRun
from kvdiag.model.kinds import Confidence, EnginePhase, GilState, ProcessRole, VerdictKind
from kvdiag.model.run import BannerInfo, EngineRecord, Finding, TimelineEvent
from kvdiag.model.verdict import ABComparison, EvidenceItem, Verdict
from kvdiag.report import run_view, write_view

MARK = "KVDIAG-PWNED"
PAYLOADS = [
    f"<script>window.__pwned=1;console.log('{MARK}');"
    "document.documentElement.setAttribute('data-pwned','script')</script>",
    f"<img src=x onerror=\"document.title='pwned';console.log('{MARK}')\">",
    f"<svg onload=\"document.documentElement.setAttribute('data-pwned','svg');console.log('{MARK}')\"></svg>",
    f"\"'><script>console.log('{MARK}');document.documentElement.setAttribute('data-pwned','attr')</script>",
    f"</script><script>console.log('{MARK}');document.documentElement.setAttribute('data-pwned','json')</script>",
    f"<a href=\"javascript:console.log('{MARK}')\" id=\"pwned-link\">x</a><!--",
]


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _bundle(bundle_dir: Path) -> tuple[Bundle, Verdict]:
    p = PAYLOADS
    (bundle_dir / "raw").mkdir(parents=True)
    (bundle_dir / "logs").mkdir()
    (bundle_dir / "raw" / "py-spy-200.txt").write_text("\n".join(p))
    (bundle_dir / "logs" / "engine.log").write_text("\n".join(p) + "\n")
    banner = BannerInfo(num_layers=28, mem_size_per_layer_mb=11, total_mem_size_mb=667, page_size_mb=2,
                        world_size=1, pp_rank=0, async_sched=True, contiguous_layout=True, enable_prealloc=True,
                        num_kv_buffers=2, group_id=0, min_reserved_pages=5, max_reserved_pages=5,
                        raw=f"Init C++ PageAllocator: num_layers=28 {p[0]}")
    engine_name = f"model {p[1]}"
    bundle = Bundle(
        command="repro two-engine", host={"kernel": p[2]}, scenario_path=p[3],
        engines=[EngineRecord(name=engine_name, allocator=p[4], phase=EnginePhase.STALLED, banners=[banner],
                              last_log_line=p[0], log_tail=list(p), error=p[1], log_path="logs/engine.log",
                              url=p[5], pids={"api_server": 199, "engine_core": 200})],
        processes=[ProcessEvidence(
            pid=200, comm=p[1], cmdline=["vllm", "serve", p[0], "--served-model-name", p[1]], engine=engine_name,
            role=ProcessRole.ENGINE_CORE, wchan=p[2],
            tools=[ToolRun(tool="py-spy", ok=False, error=p[3], raw_path="raw/py-spy-200.txt")],
            threads=[ThreadEvidence(tid=200, name=p[0], gil=GilState.HOLDS, kernel_stack=[p[1]],
                                    frames=[Frame(name=p[4], file=p[5], line=1, source=p[0]),
                                            Frame(name="alloc_page")],
                                    frames_by_tool={"py-spy": [Frame(name=p[2])]}),
                     ThreadEvidence(tid=201, name=p[3], gil=GilState.WAITING, frames=[Frame(name="take_gil")])])],
        timeline=[TimelineEvent(t=0.0, event=p[0], engine=engine_name, detail=p[1]),
                  TimelineEvent(t=1.0, event=p[4], detail=p[5])],
        findings=[Finding(kind=p[2], message=p[3], engine=engine_name)],
    )
    verdict = Verdict(
        kind=VerdictKind.GIL_CYCLE, confidence=Confidence.HIGH, engine=engine_name, summary=p[0],
        evidence=[EvidenceItem(pid=200, tid=200, role=p[1], frames=[p[2], "alloc_page"], engine=engine_name),
                  EvidenceItem(pid=200, tid=201, role=p[5], frames=["take_gil"])],
        cycle=[p[0], p[1], "GIL"],
    )
    return bundle, verdict


class _Dump(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.title = ""
        self.titles = 0                  # SVG tooltips are <title> too; the page's is the first
        self.text: list[str] = []
        self._where: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._where = tag if tag in ("title", "script", "style") else None
        if tag == "title":
            self.titles += 1

    def handle_endtag(self, tag: str) -> None:
        self._where = None

    def handle_data(self, data: str) -> None:
        if self._where == "title" and self.titles == 1:
            self.title += data
        if self._where not in ("script", "style"):
            self.text.append(data)


def _load_in_chromium(browser: str, html: Path, tmp_path: Path) -> tuple[_Dump, str]:
    """Open ``html`` in headless Chromium; the DOM after scripts ran, and the browser's log."""
    profile = tmp_path / "chromium-profile"
    env = dict(os.environ, HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "cfg"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--no-first-run", "--disable-component-update", "--disable-sync", "--disable-extensions",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000",
           "--dump-dom", html.resolve().as_uri()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        dom_dump, log = proc.communicate(timeout=120)
    finally:
        # Chromium's helper processes share its process group; leave none behind.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    assert proc.returncode == 0, log[-2000:]
    dump = _Dump()
    dump.feed(dom_dump)
    return dump, log


def _assert_nothing_ran(dump: _Dump, log: str) -> None:
    html_attrs = next(attrs for tag, attrs in dump.tags if tag == "html")
    assert html_attrs.get("data-kvdiag-js") == "ok", "the page's own script did not run (positive control)"
    assert "data-pwned" not in html_attrs, f"an injected script ran: {html_attrs}"
    assert MARK not in log, "an injected script wrote to the console"
    tags = [tag for tag, _ in dump.tags]
    assert "img" not in tags and tags.count("script") == 2
    assert not any(attrs.get("id") == "pwned-link" for _, attrs in dump.tags)
    assert not any(name.startswith("on") for _, attrs in dump.tags for name in attrs)



def _ab_carrying(text: str) -> ABComparison:
    """Both A/B sides with ``text`` as their summary, an engine's name and its health line."""
    side = {"verdict": "gil_cycle", "summary": text, "exit_code": 10, "report": "stock/report.html",
            "engines": {text: {"phase": "stalled", "health": text}}}
    return ABComparison.model_validate({"stock": side, "fixed": dict(side, verdict="healthy"), "separated": True})


def test_injected_markup_is_text_and_never_runs(tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    bundle, verdict = _bundle(tmp_path / "bundle")
    diag = diagnosis_of(bundle, verdict, exit_code=10, verdicts_by_engine={f"eng {PAYLOADS[0]}": verdict},
                        ab=_ab_carrying(PAYLOADS[2]))
    view = run_view(bundle, diag, out_dir=tmp_path, bundle_dir=tmp_path / "bundle", command=f"repro {PAYLOADS[1]}")
    paths = write_view(tmp_path, view)
    dump, log = _load_in_chromium(browser, paths["report.html"], tmp_path)
    _assert_nothing_ran(dump, log)
    assert dump.title == "kvdiag A/B: separated"
    text = "".join(dump.text)
    for payload in PAYLOADS:
        assert text.count(payload) >= 2, f"payload not shown as text: {payload!r}"


def test_payloads_from_a_real_engine_log_stay_text(tmp_path: Path) -> None:
    """The whole pipeline: an engine prints the payloads, kvdiag repro stalls on it, captures it
    and writes report.html; Chromium loads that file."""
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    payload_file = tmp_path / "payloads.txt"
    payload_file.write_text("\n".join(PAYLOADS) + "\n")
    engine = Path(__file__).resolve().parent.parent / "fixtures" / "engines" / "hostile.py"

    def cmd(*extra: str) -> str:
        return json.dumps([sys.executable, str(engine), "--payloads", str(payload_file), *extra])

    model = json.dumps(f"org/model {PAYLOADS[1]}")
    scen = tmp_path / "hostile.yaml"
    scen.write_text(f"""
name: hostile
windows: {{stall_s: 2, startup_timeout_s: 30, timeout_s: 60, poll_s: 0.1, kill_grace_s: 0.5}}
engines:
  - name: one
    kind: command
    model: {model}
    command: {cmd("--", PAYLOADS[0])}
    ready: "log:READY"
  - name: two
    kind: command
    model: {model}
    start_after: one
    command: {cmd("--never-ready", "--", PAYLOADS[2])}
    ready: "log:READY"
""")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "repro", "two-engine", "--scenario", str(scen),
                           "--out", str(out)], capture_output=True, text=True, timeout=150)
    assert proc.returncode in (0, 10), proc.stderr[-3000:]
    html = out / "report.html"
    assert html.exists(), proc.stderr[-3000:]
    dump, log = _load_in_chromium(browser, html, tmp_path)
    _assert_nothing_ran(dump, log)
    text = "".join(dump.text)
    for payload in PAYLOADS:
        # each payload reached the page (log tail, last line, command line) and shows as text
        assert payload in text, f"payload not shown as text: {payload!r}"
