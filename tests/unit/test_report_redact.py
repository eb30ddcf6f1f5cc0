"""Secret redaction: named secrets, headers, URLs, token shapes; no over-redaction of normal log text."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.model.evidence import ProcessEvidence, ThreadEvidence
from kvdiag.redact.rules import REDACTED, is_secret_name, redact_obj, redact_shapes, redact_text

HF = "hf_" + "Abc123XyZ" * 4
SK = "sk-proj-" + "Q1w2E3r4T5y6U7i8" * 2


@pytest.mark.parametrize(("text", "secret"), [
    (f"HF_TOKEN={HF}", HF),
    ("HUGGING_FACE_HUB_TOKEN=plainvalue123", "plainvalue123"),
    (f'export OPENAI_API_KEY="{SK}"', SK),
    ("WANDB_API_KEY='abc def 123'", "abc def 123"),
    ('{"HF_TOKEN": "jsonsecret42", "port": 8000}', "jsonsecret42"),
    ("non-default args: {'model': 'm', 'api_key': 'reprsecret9', 'max_num_batched_tokens': 2048}", "reprsecret9"),
    ("vllm serve m --api-key flagsecret1 --port 8000", "flagsecret1"),
    ("vllm serve m --hf-token flagsecret2", "flagsecret2"),
    ("vllm serve m --api-key=flagsecret3", "flagsecret3"),
    ("curl -H 'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig' http://x", "eyJhbGciOiJIUzI1NiJ9"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA"),
    ('"authorization": "Token tok_live_123456"', "tok_live_123456"),
    ("proxy-authorization: Negotiate YIIabc123", "YIIabc123"),
    ("X-Api-Key: hdrsecret77", "hdrsecret77"),
    ("bearer abcdef0123456789", "abcdef0123456789"),
    ("pulling https://alice:pa55w0rd@huggingface.example/m", "pa55w0rd"),
    ("redis://:onlypass@127.0.0.1:6379/0", "onlypass"),
    ("DB_PASSWORD=hunter2", "hunter2"),
    ("password: hunter3", "hunter3"),
    ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCY", "wJalrXUtnFEMI"),
    ("key id AKIAIOSFODNN7EXAMPLE in use", "AKIAIOSFODNN7EXAMPLE"),
    ("token ghp_" + "a1B2c3D4e5" * 4 + " leaked", "a1B2c3D4e5a1B2c3D4e5"),
    (f"loading with {HF} from cache", HF),
    (f"client key {SK}", SK),
    ("MY_SERVICE_SECRET=s3cr3t CLIENT_SECRET=abc", "s3cr3t"),
    ("HF_TOKEN=envsecret1\x00PATH=/usr/bin", "envsecret1"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\n-----END RSA PRIVATE KEY-----", "MIIEowIBAAKCAQEA"),
])
def test_secret_removed(text: str, secret: str) -> None:
    out = redact_text(text)
    assert secret not in out
    assert REDACTED in out
    assert redact_text(out) == out  # idempotent


@pytest.mark.parametrize("text", [
    "max_num_batched_tokens=2048",
    "non-default args: {'max_num_batched_tokens': 2048, 'max_model_len': 512}",
    "--max-num-batched-tokens 2048 --tokenizer /tmp/tiny-llama --tokenizer-mode auto",
    "eos_token_id=2 bos_token_id=1 pad_token=<pad> 'eos_token': '</s>'",
    "Engine 000: Avg prompt throughput: 0.0 tokens/s, Running: 6 reqs, CPU KV cache usage: 100.0%",
    "vllm:prompt_tokens_total 1234.0",
    "CPU KV cache size: 2,048 tokens, Maximum concurrency for 512 tokens per request: 4.00x",
    "token=None api_key: null HF_TOKEN=$HF_TOKEN",
    "requires a bearer token",
    "---------------Inter-token Latency----------------",
    "Init C++ PageAllocator: num_layers=28, mem_size_per_layer=11MB, page_size=2MB, enable_prealloc=1",
    "GET http://127.0.0.1:8000/health HTTP/1.1 200 OK",
    "kvcached::PageAllocator::alloc_page (csrc/page_allocator.cpp:212)",
])
def test_normal_text_survives(text: str) -> None:
    assert redact_text(text) == text


def test_real_vllm_outputs_unchanged() -> None:
    """Captures of a real vLLM run (no secrets in them) must come through byte for byte."""
    shared = Path(__file__).resolve().parents[3] / "shared" / "vllm"
    files = sorted(shared.glob("*.txt")) + sorted(shared.glob("*.log"))
    if not files:
        pytest.skip(f"{shared} not present (shared captures of a real vLLM run)")
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        assert redact_text(text) == text, f.name


@pytest.mark.parametrize(("name", "secret"), [
    ("HF_TOKEN", True), ("hf_token", True), ("--hf-token", True), ("OPENAI_API_KEY", True), ("x-api-key", True),
    ("token", True), ("Authorization", True), ("DB_PASSWORD", True), ("cfg.api_key", True),
    ("max_num_batched_tokens", False), ("eos_token", False), ("pad_token", False), ("tokenizer", False),
    ("TOKENS", False), ("num_tokens", False), ("KVCACHED_IPC_NAME", False),
])
def test_is_secret_name(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_redact_obj_keys_values_argv_and_models() -> None:
    data = {
        "env": {"HF_TOKEN": "abc", "PATH": "/usr/bin", "RETRIES": 3, "API_KEY": None},
        "cmd": ["vllm", "serve", "--api-key", "argvsecret", "--port", "8000"],
        f"engine {HF}": {"ok": True},
        "nested": [("--token", "tup"), {"password": 12345}],
    }
    out = redact_obj(data)
    assert out["env"] == {"HF_TOKEN": REDACTED, "PATH": "/usr/bin", "RETRIES": 3, "API_KEY": None}
    assert out["cmd"] == ["vllm", "serve", "--api-key", REDACTED, "--port", "8000"]
    assert f"engine {REDACTED}" in out and not any(HF in k for k in out)
    assert out["nested"] == [("--token", REDACTED), {"password": REDACTED}]
    assert data["env"]["HF_TOKEN"] == "abc"  # input untouched

    proc = ProcessEvidence(pid=1, cmdline=["python", "--hf-token", "modelsecret"],
                           threads=[ThreadEvidence(tid=2, name=f"worker {SK}")])
    safe = redact_obj(proc)
    assert isinstance(safe, ProcessEvidence)
    assert "modelsecret" not in safe.model_dump_json() and SK not in safe.model_dump_json()
    assert proc.cmdline[-1] == "modelsecret"


def test_redact_shapes_is_markup_safe() -> None:
    html = f'<td class="x">{HF}</td><a href="#pid-1">Bearer abcdef123456</a>'
    out = redact_shapes(html)
    assert HF not in out and "abcdef123456" not in out
    assert out.startswith('<td class="x">') and out.endswith("</a>")


@settings(max_examples=200, deadline=None)
@given(prefix=st.text(max_size=60), suffix=st.text(max_size=60))
def test_planted_token_always_removed_and_idempotent(prefix: str, suffix: str) -> None:
    text = f"{prefix} HF_TOKEN={HF} {suffix}"
    out = redact_text(text)
    assert HF not in out
    assert redact_text(out) == out
