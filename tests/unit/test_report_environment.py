"""The environment record and the hang signature reach every rendering, escaped and redacted."""

from __future__ import annotations

import json
from pathlib import Path

from reportkit import build_report, view_of, write_outputs
from rich.console import Console

from kvdiag.analyze.overall import analyze
from kvdiag.bundle.io import load_bundle
from kvdiag.environment import collect_environment
from kvdiag.kvcached.build import fingerprint_tree
from kvdiag.model.environment import (
    InterpreterPackages,
    IpcSocket,
    KvcachedBuild,
    KvcachedRuntime,
    ShmSegment,
)
from kvdiag.report.terminal import render_terminal

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_environment_and_signature_in_json_html_md_and_terminal(tmp_path: Path) -> None:
    bundle, _ = load_bundle(FIXTURES / "bundles" / "gil_cycle")
    env = collect_environment(gpus=False, runtime=False,
                              environ={"KVCACHED_PAGE_PREALLOC_ENABLED": "true", "HF_TOKEN": "hf_" + "x" * 34,
                                       "VLLM_LOGGING_PREFIX": "<script>alert(1)</script>"})
    env.kvcached = fingerprint_tree(FIXTURES / "kvcached_prefix", version="0.1.5")
    env.kvcached_runtime = KvcachedRuntime(segments=[ShmSegment(name="VLMM", total_bytes=1, used_bytes=0,
                                                                prealloc_bytes=0, pids=[4242])],
                                           sockets=[IpcSocket(path="/tmp/kvcached-tp-VLMM-0/w0.sock",
                                                              listener_pids=[4242], peer_pids=[4243])])
    bundle.environment = env
    verdict = analyze(bundle)
    assert verdict.signature
    paths = write_outputs(tmp_path, bundle, verdict, command="capture --pid 1", exit_code=10)
    data = json.loads(paths["report.json"].read_text())
    assert data["verdict"]["signature"] == verdict.signature
    assert data["verdict"]["known"]["id"] == "kvcached#371" and data["verdict"]["known"]["fixed_in"] == "0.1.6"
    assert data["environment"]["kvcached"]["verdict"] == "pre_fix"
    assert data["environment"]["env"]["KVCACHED_PAGE_PREALLOC_ENABLED"] == "true"
    page = paths["report.html"].read_text()
    md = paths["report.md"].read_text()
    for text in (page, md):
        assert verdict.signature in text and "kvcached#371" in text and "first in 0.1.6" in text
        assert "pre_fix" in text and "/tmp/kvcached-tp-VLMM-0/w0.sock" in text
        assert "hf_xxxx" not in text, [ln for ln in text.splitlines() if "hf_xxxx" in ln]
    assert "<script>alert(1)" not in page and "&lt;script&gt;" in page
    con = Console(record=True, width=200)
    render_terminal(view_of(build_report(bundle, verdict, command="capture", exit_code=10)), con)
    out = con.export_text()
    assert f"signature: {verdict.signature}" in out and "known: kvcached#371" in out
    assert "environment:" in out and "(pre_fix)" in out


def test_each_engine_interpreters_kvcached_build_is_rendered_labelled(tmp_path: Path) -> None:
    bundle, _ = load_bundle(FIXTURES / "bundles" / "gil_cycle")
    env = collect_environment(gpus=False, runtime=False, environ={})
    env.kvcached = KvcachedBuild(installed=False, verdict="absent", summary="kvcached is not installed")
    engine_build = fingerprint_tree(FIXTURES / "kvcached_prefix", version="0.1.5")
    env.engine_packages = [InterpreterPackages(who="engine vlm", python="/venvs/vllm/bin/python", engines=["vlm"],
                                               packages={"vllm": "0.32.0", "kvcached": "0.1.5"},
                                               kvcached=engine_build)]
    bundle.environment = env
    paths = write_outputs(tmp_path, bundle, analyze(bundle), command="repro", exit_code=10)
    data = json.loads(paths["report.json"].read_text())
    assert data["environment"]["engine_packages"][0]["kvcached"]["verdict"] == "pre_fix"
    page, md = paths["report.html"].read_text(), paths["report.md"].read_text()
    assert "kvcached build of engine vlm" in page and "kvcached build (kvdiag's Python)" in page
    assert "kvcached 0.1.5 (engine vlm: /venvs/vllm/bin/python)" in md and "pre_fix" in md
    assert "kvcached (kvdiag's Python): kvcached is not installed" in md
    con = Console(record=True, width=300)
    render_terminal(view_of(build_report(bundle, analyze(bundle), command="repro", exit_code=10)), con)
    assert "kvcached 0.1.5 (pre_fix)" in con.export_text()   # the terminal's package line: the engine's verdict
