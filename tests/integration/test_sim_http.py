"""The simulated engine as an HTTP server: vLLM's routes, SSE framing, metrics, process tree, shutdown.

Every test talks to real `python -m kvdiag.sim serve` processes on free ports; every process is
torn down (process group, SIGTERM then SIGKILL) when its fixture ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdiag.allocator import remove_device_files
from kvdiag.osread.children import children
from kvdiag.osread.ptable import alive as process_alive
from kvdiag.sim.harness import SimProcess

pytestmark = pytest.mark.timeout(120)

# Captured from real vLLM 0.32.0 (shared/vllm/stream.txt): the first and the last event of a
# streaming /v1/completions, and the events of a streaming chat completion with include_usage.
VLLM_COMPLETION_FIRST = ('{"id":"cmpl-b998519ba4582133","object":"text_completion","created":1796278594,'
                         '"model":"/tmp/tiny-llama","choices":[{"index":0,"text":"igh","logprobs":null,'
                         '"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}')
VLLM_COMPLETION_LAST = ('{"id":"cmpl-b998519ba4582133","object":"text_completion","created":1796278594,'
                        '"model":"/tmp/tiny-llama","choices":[{"index":0,"text":"ssist","logprobs":null,'
                        '"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null}],'
                        '"system_fingerprint":"vllm-0.32.0-2407ee55"}')
VLLM_CHAT_ROLE = ('{"id":"chatcmpl-a8b7a5628ab90c26","object":"chat.completion.chunk","created":1796278594,'
                  '"model":"/tmp/tiny-llama","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                  '"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}')
VLLM_CHAT_TOKEN = ('{"id":"chatcmpl-a8b7a5628ab90c26","object":"chat.completion.chunk","created":1796278594,'
                   '"model":"/tmp/tiny-llama","choices":[{"index":0,"delta":{"content":""},"logprobs":null,'
                   '"finish_reason":null,"token_ids":null}]}')
VLLM_CHAT_LAST = ('{"id":"chatcmpl-a8b7a5628ab90c26","object":"chat.completion.chunk","created":1796278594,'
                  '"model":"/tmp/tiny-llama","choices":[{"index":0,"delta":{"content":"G"},"logprobs":null,'
                  '"finish_reason":"length","stop_reason":null,"token_ids":null}]}')
VLLM_CHAT_USAGE = ('{"id":"chatcmpl-a8b7a5628ab90c26","object":"chat.completion.chunk","created":1796278594,'
                   '"model":"/tmp/tiny-llama","choices":[],"usage":{"prompt_tokens":15,"total_tokens":20,'
                   '"completion_tokens":5},"system_fingerprint":"vllm-0.32.0-2407ee55"}')
VLLM_COMPLETION_FULL = (
    '{"id":"cmpl-aa9e8d9db286c929","object":"text_completion","created":1796278594,"model":"/tmp/tiny-llama",'
    '"choices":[{"index":0,"text":"Hitdelfastser key","logprobs":null,"finish_reason":"length","stop_reason":null,'
    '"token_ids":null,"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}],"service_tier":null,'
    '"system_fingerprint":"vllm-0.32.0-2407ee55","usage":{"prompt_tokens":2,"total_tokens":7,"completion_tokens":5,'
    '"prompt_tokens_details":null,"completion_tokens_details":null},"kv_transfer_params":null,'
    '"ec_transfer_params":null,"metrics":null}')

# vLLM's log line: "(EngineCore pid=6898) INFO 12-03 06:15:40 [core.py:133] message"
LOG_LINE = re.compile(r"^\((?P<who>APIServer|EngineCore) pid=(?P<pid>\d+)\) (INFO|WARNING|ERROR|DEBUG) "
                      r"\d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+\.py:\d+\] ")


def shape(value: Any) -> Any:
    """Keys in order, recursively, with leaf values reduced to their JSON type."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def raw_post(port: int, path: str, payload: dict[str, Any], timeout_s: float = 20.0) -> tuple[bytes, bytes]:
    """POST over a plain socket; returns (header block, de-chunked body) exactly as sent."""
    data = json.dumps(payload).encode()
    req = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           f"content-length: {len(data)}\r\nconnection: close\r\n\r\n").encode() + data
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(req)
        raw = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            part = s.recv(65536)
            if not part:
                break
            raw += part
    head, _, rest = raw.partition(b"\r\n\r\n")
    body = b""
    if b"transfer-encoding: chunked" in head.lower():
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2:]
    else:
        body = rest
    return head, body


def sse_events(body: bytes) -> list[str]:
    """Split an SSE body on vLLM's framing; asserts nothing but `data: ` lines separated by blank lines."""
    text = body.decode("utf-8")
    assert text.endswith("\n\n"), "every event ends with a blank line"
    events = text[:-2].split("\n\n")
    for ev in events:
        assert ev.startswith("data: ") and "\n" not in ev, f"not a single data line: {ev!r}"
    return [ev[len("data: "):] for ev in events]


@pytest.fixture(scope="module")
def device() -> Iterator[str]:
    name = f"kvdt{uuid.uuid4().hex[:10]}"
    yield name
    remove_device_files(name)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, device: str) -> Iterator[SimProcess]:
    log = tmp_path_factory.mktemp("sim") / "server.log"
    sp = SimProcess(log, allocator="stock", layers=4, kv_per_layer_mb=64, model="sim/test-model",
                    device_name=device, weights_gb=2, step_ms=2)
    with sp:
        assert sp.wait_healthy(30), sp.log_text()[-3000:]
        yield sp


def test_health_and_models(server: SimProcess) -> None:
    r = httpx.get(f"{server.url}/health", timeout=5, trust_env=False)
    assert r.status_code == 200 and r.content == b""
    models = httpx.get(f"{server.url}/v1/models", timeout=5, trust_env=False).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["sim/test-model"]
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=5,
                     trust_env=False)
    assert bad.status_code == 404 and bad.json()["error"]["type"] == "NotFoundError"
    too_long = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 10**6}, timeout=5,
                          trust_env=False)
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]


def test_completion_non_streaming_matches_vllm_shape(server: SimProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "sim/test-model", "prompt": "hello world",
                                                         "max_tokens": 5}, timeout=10, trust_env=False)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert shape(body) == shape(json.loads(VLLM_COMPLETION_FULL))
    assert body["usage"] == {"prompt_tokens": 2, "total_tokens": 7, "completion_tokens": 5,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["id"].startswith("cmpl-") and body["model"] == "sim/test-model"


def test_completion_sse_framing_matches_vllm(server: SimProcess) -> None:
    head, body = raw_post(server.port, "/v1/completions",
                          {"model": "sim/test-model", "prompt": "hello world", "max_tokens": 5, "stream": True})
    assert head.startswith(b"HTTP/1.1 200 OK")
    headers = head.decode().lower()
    assert "content-type: text/event-stream; charset=utf-8" in headers
    assert "transfer-encoding: chunked" in headers
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 5, "one event per token"
    assert shape(chunks[0]) == shape(json.loads(VLLM_COMPLETION_FIRST))
    for mid in chunks[1:-1]:
        assert shape(mid) == shape(json.loads(VLLM_COMPLETION_FIRST))
    assert shape(chunks[-1]) == shape(json.loads(VLLM_COMPLETION_LAST))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1
    # No space lost between "data:" and the payload, no event:/id: fields, compact JSON like vLLM.
    assert body.startswith(b'data: {"id":"cmpl-')
    assert b"event:" not in body and b"\nid:" not in body and b'", "' not in body


def test_chat_sse_with_usage_matches_vllm(server: SimProcess) -> None:
    _, body = raw_post(server.port, "/v1/chat/completions",
                       {"model": "sim/test-model", "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 1 + 5 + 1, "role chunk, one per token, usage chunk"
    assert shape(chunks[0]) == shape(json.loads(VLLM_CHAT_ROLE))
    for mid in chunks[1:5]:
        assert shape(mid) == shape(json.loads(VLLM_CHAT_TOKEN))
    assert shape(chunks[5]) == shape(json.loads(VLLM_CHAT_LAST))
    assert shape(chunks[6]) == shape(json.loads(VLLM_CHAT_USAGE))
    assert chunks[6]["usage"] == {"prompt_tokens": 15, "total_tokens": 20, "completion_tokens": 5}
    # Non-streaming chat: one message with the same text the stream would carry.
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}, timeout=10,
                   trust_env=False)
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert r.json()["usage"]["completion_tokens"] == 3


def _metrics(url: str) -> dict[str, list[Any]]:
    text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = list(fam.samples)
        out[f"__type__{fam.name}"] = [fam.type]
    return out


def _value(families: dict[str, list[Any]], family: str, sample: str, **labels: str) -> float:
    for s in families[family]:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise AssertionError(f"no sample {sample} {labels} in {family}")


def test_metrics_parse_and_follow_engine_state(server: SimProcess) -> None:
    before = _metrics(server.url)
    for fam, kind in (("vllm:kv_cache_usage_perc", "gauge"), ("vllm:num_requests_running", "gauge"),
                      ("vllm:num_requests_waiting", "gauge"), ("vllm:num_preemptions", "counter"),
                      ("vllm:prompt_tokens", "counter"), ("vllm:generation_tokens", "counter"),
                      ("vllm:time_to_first_token_seconds", "histogram"),
                      ("vllm:inter_token_latency_seconds", "histogram"),
                      ("vllm:e2e_request_latency_seconds", "histogram"), ("vllm:request_success", "counter")):
        assert before[f"__type__{fam}"] == [kind], fam
        for s in before[fam]:
            assert s.labels.get("engine") == "0" and s.labels.get("model_name") == "sim/test-model"
    gen0 = _value(before, "vllm:generation_tokens", "vllm:generation_tokens_total")
    ttft0 = _value(before, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count")
    ok0 = _value(before, "vllm:request_success", "vllm:request_success_total", finished_reason="length")
    for _ in range(3):
        raw_post(server.port, "/v1/completions", {"prompt": "a b c d", "max_tokens": 7, "stream": True})
    after = _metrics(server.url)
    assert _value(after, "vllm:generation_tokens", "vllm:generation_tokens_total") == gen0 + 21
    assert _value(after, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == ttft0 + 3
    assert _value(after, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == ok0 + 3
    itl = _value(after, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count")
    assert itl >= 18  # 6 gaps per request
    inf = _value(after, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_bucket", le="+Inf")
    assert inf == itl
    # Idle again: nothing running, only the null block held.
    assert _value(after, "vllm:num_requests_running", "vllm:num_requests_running") == 0
    usage = _value(after, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
    assert 0 < usage < 0.5


def test_client_disconnect_aborts_the_request(server: SimProcess) -> None:
    before = _metrics(server.url)
    aborted0 = _value(before, "vllm:request_success", "vllm:request_success_total", finished_reason="abort")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        data = json.dumps({"prompt": "x", "max_tokens": 3000, "stream": True}).encode()
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  f"content-length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while got.count(b"data: {") < 3:
            got += s.recv(65536)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = _metrics(server.url)
        if _value(after, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") > aborted0:
            break
        time.sleep(0.1)
    assert _value(after, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == aborted0 + 1
    assert _value(after, "vllm:num_requests_running", "vllm:num_requests_running") == 0


def test_process_tree_titles_and_log_format(server: SimProcess) -> None:
    core = server.engine_core_pid(5)
    assert core is not None
    assert Path(f"/proc/{core}/comm").read_text().strip() == "VLLM::EngineCor"
    assert Path(f"/proc/{core}/cmdline").read_bytes().split(b"\0")[0] == b"VLLM::EngineCore"
    stat = Path(f"/proc/{core}/stat").read_text().rsplit(")", 1)[-1].split()
    assert int(stat[1]) == server.pid, "EngineCore is a child of the API server"
    assert int(stat[2]) == os.getpgid(server.pid), "same process group as the API server"
    for task in Path(f"/proc/{core}/task").iterdir():
        assert (task / "comm").read_text().strip() == "VLLM::EngineCor"
    log = server.log_text()
    prefixed = [m for m in (LOG_LINE.match(line) for line in log.splitlines()) if m]
    assert {m.group("who") for m in prefixed} == {"APIServer", "EngineCore"}
    assert {int(m.group("pid")) for m in prefixed if m.group("who") == "EngineCore"} == {core}
    assert {int(m.group("pid")) for m in prefixed if m.group("who") == "APIServer"} == {server.pid}
    order = ["Starting to load model", "Model loading took", "Available KV cache memory",
             "init engine (profile, create kv cache, warmup model) took", "Init C++ PageAllocator: num_layers=4,",
             "Starting vLLM server on http://", f"Started server process [{server.pid}]",
             "Application startup complete."]
    positions = [log.find(marker) for marker in order]
    assert all(p >= 0 for p in positions), list(zip(order, positions, strict=True))
    assert positions == sorted(positions)
    assert re.search(r"^Init C\+\+ PageAllocator: num_layers=4, mem_size_per_layer=64MB, total_mem_size=512MB, "
                     r"page_size=2MB, world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1, enable_prealloc=1, "
                     r"num_kv_buffers=2, group_id=0, min_reserved_pages=5, max_reserved_pages=10$", log, re.M)
    assert "kvdiag simulated engine (not vLLM)" in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_down_engine_core_first(tmp_path: Path, device: str, sig: int) -> None:
    with SimProcess(tmp_path / "sig.log", allocator="fixed", layers=2, kv_per_layer_mb=64, device_name=device,
                    step_ms=5) as sp:
        assert sp.wait_healthy(30), sp.log_text()[-2000:]
        core = sp.engine_core_pid(5)
        assert core is not None
        # A stream in flight when the signal arrives.
        stream = socket.create_connection(("127.0.0.1", sp.port), timeout=10)
        data = json.dumps({"prompt": "x", "max_tokens": 3000, "stream": True}).encode()
        stream.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       f"content-length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while b"data: {" not in got:
            part = stream.recv(65536)
            assert part, "stream closed before the first token"
            got += part
        t0 = time.monotonic()
        sp.signal(sig)
        while process_alive(core) and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        core_gone_s = time.monotonic() - t0
        rc = sp.wait_exit(10)
        stream.close()
        assert not process_alive(core)
        assert core_gone_s < 4.0, f"EngineCore took {core_gone_s:.2f}s to go"  # lingering bound, not speed
        assert rc == 0
        log = sp.log_text()
        assert "[shutdown] API server: shutdown triggered" in log
        assert "[shutdown] Process manager: send sigterm to process EngineCore" in log
        assert "Application shutdown complete." in log


def test_engine_core_dies_with_its_parent(tmp_path: Path, device: str) -> None:
    with SimProcess(tmp_path / "orphan.log", allocator="fixed", layers=2, kv_per_layer_mb=64,
                    device_name=device) as sp:
        assert sp.wait_healthy(30), sp.log_text()[-2000:]
        core = sp.engine_core_pid(5)
        assert core is not None and core in children(sp.pid)
        sp.signal(signal.SIGKILL)
        sp.wait_exit(5)
        deadline = time.monotonic() + 5
        while process_alive(core) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not process_alive(core), "EngineCore outlived a SIGKILLed API server"
