"""The one redactor: secret flags by name, credential shapes, counting, the bundle summary, the folder scanner."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from kvdiag.bundle.io import save_bundle
from kvdiag.cli.main import main as kvdiag_main
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence, ThreadEvidence, ToolRun
from kvdiag.redact.files import scan_tree
from kvdiag.redact.rules import (
    KINDS,
    REDACTED,
    Tally,
    is_secret_flag,
    is_secret_name,
    redact_argv,
    redact_obj,
    redact_text,
    scan_text,
)

PLAIN = "Zq7plainValue42x"   # no credential shape: only the flag's name can tell it is secret
SHAPES = {
    "hugging_face": "hf_" + "Ab3dE" * 5,
    "openai": "sk-proj-" + "Q1w2E3r4T5y6U7i8",
    "github": "ghp_" + "a1B2c3D4e5" * 4,
    "aws_key_id": "AKIA" + "ABCDEFGHIJKLMNOP",
    "slack": "xoxb-123456789012-abcdefABCDEF",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV",
}


@pytest.mark.parametrize("flag", [
    "--api-key", "--hf-token", "--client-secret", "--db-password", "--passwd", "--auth", "--basic-auth-string",
    "--credential", "--gcp-credentials-json", "--github-token-value", "--apikey", "--hftoken", "-token",
])
@pytest.mark.parametrize("form", ["space", "equals", "argv_repr", "json_list"])
def test_any_flag_naming_a_secret_loses_its_value(flag: str, form: str) -> None:
    text = {"space": f"serve m {flag} {PLAIN} --port 8000",
            "equals": f"serve m {flag}={PLAIN} --port 8000",
            "argv_repr": f"['serve', '{flag}', '{PLAIN}', '--port', '8000']",
            "json_list": f'["serve", "{flag}", "{PLAIN}", "--port", "8000"]'}[form]
    tally = Tally()
    out = redact_text(text, tally)
    assert PLAIN not in out and REDACTED in out and "8000" in out
    assert tally.total == 1 and set(tally.as_dict()) <= {"secret_flag", "secret_name"}
    assert redact_text(out) == out
    assert scan_text(text) and not scan_text(out)


@pytest.mark.parametrize("flag", [
    "--max-num-batched-tokens", "--tokenizer", "--tokenizer-mode", "--max-tokens", "--port", "--model",
    "--author", "--num-speculative-tokens",
])
def test_flags_that_name_counts_or_tokenizers_keep_their_value(flag: str) -> None:
    assert not is_secret_flag(flag)
    text = f"serve m {flag} {PLAIN}"
    assert redact_text(text) == text


def test_argv_list_from_proc_is_redacted_element_wise() -> None:
    argv = ["python3", "serve.py", "--api-key", PLAIN, "--token=" + PLAIN, "--gh", SHAPES["github"],
            "--x-credential-file", "/etc/cred", "--enable-auth", "--port", "8000"]
    tally = Tally()
    out = redact_argv(argv, tally)
    assert PLAIN not in " ".join(out) and SHAPES["github"] not in out and "/etc/cred" not in out
    assert out[-3:] == ["--enable-auth", "--port", "8000"]   # a bare flag does not eat the next flag
    assert tally.total == 4


@pytest.mark.parametrize(("kind", "value"), list(SHAPES.items()))
def test_credential_shapes_whatever_the_flag(kind: str, value: str) -> None:
    text = f"serve m --x1 {value} ; env SOME_SETTING={value}"
    tally = Tally()
    out = redact_text(text, tally)
    assert value not in out
    assert tally.as_dict() == {kind: 2}
    assert [k for _, k in scan_text(text)] == [kind]


def test_bearer_and_url_userinfo() -> None:
    tally = Tally()
    out = redact_text("curl -H 'X: Bearer abcdef0123456789' postgres://app:pw0rd99@db:5432/x", tally)
    assert "abcdef0123456789" not in out and "pw0rd99" not in out and "app:" not in out
    assert tally.as_dict() == {"bearer": 1, "url_userinfo": 1}
    assert redact_text(out, tally) == out and tally.total == 2   # nothing counted twice


def test_kind_names_are_not_secret_names() -> None:
    """A summary {"github": 1} must pass through the redactor untouched."""
    assert not any(is_secret_name(k) for k in KINDS)
    summary = {k: 1 for k in KINDS}
    assert redact_obj(summary) == summary


def _bundle() -> Bundle:
    proc = ProcessEvidence(pid=7, cmdline=["python", "--api-key", PLAIN],
                           threads=[ThreadEvidence(tid=7, name=f"w {SHAPES['hugging_face']}")],
                           tools=[ToolRun(tool="py-spy", ok=True, raw_path="raw/7/py-spy.txt",
                                          redactions={"secret_flag": 1})])
    return Bundle(processes=[proc], scenario={"engines": [{"env": {"HF_TOKEN": PLAIN}}]})


def test_save_bundle_redacts_and_summarises_the_same_every_time(tmp_path: Path) -> None:
    b = _bundle()
    for _ in range(2):
        path = save_bundle(b, tmp_path)
        text = path.read_text()
        assert PLAIN not in text and SHAPES["hugging_face"] not in text
        data = json.loads(text)["redaction"]
        assert data["files"]["raw/7/py-spy.txt"] == {"secret_flag": 1}
        assert data["files"]["bundle.json"] == {"hugging_face": 1, "secret_flag": 1, "secret_name": 1}
        assert data["total"] == 4 and data["by_kind"]["secret_flag"] == 2
    assert b.redaction.total == 4            # the caller's bundle carries the summary for its reports
    assert b.processes[0].cmdline[-1] == PLAIN   # ... and is otherwise untouched


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = kvdiag_main(list(argv))
    return code, out.getvalue() + err.getvalue()


def test_redact_command_exit_codes_and_never_prints_values(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "bundle" / "raw" / "7").mkdir(parents=True)
    (run / "bundle" / "raw" / "7" / "py-spy.txt").write_text(f"Process 7: python --api-key {REDACTED}\n")
    (run / "report.md").write_text("all fine, 2048 tokens\n")
    code, out = _cli("redact", str(run))
    assert code == 0 and "clean" in out
    (run / "bundle" / "raw" / "7" / "gdb.txt").write_text(f"line one\nleaked {SHAPES['github']} here\n")
    (run / "bundle" / "blob.bin").write_bytes(b"\x00\xff" + f"--hf-token {PLAIN}".encode() + b"\x00")
    code, out = _cli("redact", str(run))
    assert code == 10
    assert "bundle/raw/7/gdb.txt:2: github" in out and "bundle/blob.bin:1: secret_flag" in out
    assert SHAPES["github"] not in out and PLAIN not in out
    code, out = _cli("redact", str(run), "--json")
    assert code == 10 and {h["kind"] for h in json.loads(out)["findings"]} == {"github", "secret_flag"}
    code, out = _cli("redact", str(tmp_path / "nope"))
    assert code == 2 and "no such folder" in out
    assert {h.path for h in scan_tree(run)} == {"bundle/raw/7/gdb.txt", "bundle/blob.bin"}
