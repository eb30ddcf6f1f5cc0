"""The redaction marker keeps every redacted text well-formed: YAML, JSON, argv, HTML, URLs.

The old marker ``***REDACTED***`` made ``key: ***REDACTED***`` an unloadable YAML alias, so the
scenario copy in a bundle could not be re-run. Old bundles that carry it still count as clean.
"""

from __future__ import annotations

import html
import json
import shlex
import textwrap
import urllib.parse
from pathlib import Path

import yaml

from kvdiag.model.bundle import Bundle
from kvdiag.redact.files import scan_tree
from kvdiag.redact.rules import OLD_MARKERS, REDACTED, redact_argv, redact_text, scan_text
from kvdiag.runs.lifecycle import LaunchedRun
from kvdiag.scenario.loader import parse_scenario

HF = "hf_" + "Q7wErTyUiOpAsDfGhJkL"          # credential-shaped
PLAIN = "s3cr3t-plain-value-42"               # only its name or flag says it is secret
DB = "dbpass-9876"


def test_marker_means_itself_in_every_syntax() -> None:
    assert yaml.safe_load(f"k: {REDACTED}") == {"k": REDACTED}
    assert yaml.safe_load(f"k: {{a: {REDACTED}, b: [{REDACTED}, x]}}") == {"k": {"a": REDACTED, "b": [REDACTED, "x"]}}
    assert shlex.split(f"vllm serve --api-key {REDACTED}") == ["vllm", "serve", "--api-key", REDACTED]
    assert shlex.quote(REDACTED) == REDACTED
    assert html.escape(REDACTED) == REDACTED
    assert urllib.parse.quote(REDACTED, safe="") == REDACTED
    assert json.loads(json.dumps(REDACTED)) == REDACTED


def test_redacted_yaml_json_and_argv_stay_loadable() -> None:
    text = textwrap.dedent(f"""\
        token: {PLAIN}
        HF_TOKEN: "{HF}"
        db: postgres://admin:{DB}@db.example:5432/x
        flow: {{api_key: {PLAIN}, n: 2}}
        args: [--api-key, {PLAIN}, --port, "8000"]
        block:
          - --hf-token
          - {PLAIN}
        line: vllm serve m --api-key {PLAIN} --max-num-batched-tokens 2048
        header: "Authorization: Bearer {PLAIN}"
        """)
    out = redact_text(text)
    data = yaml.safe_load(out)
    for secret in (PLAIN, HF, DB):
        assert secret not in out
    assert data["token"] == data["HF_TOKEN"] == data["flow"]["api_key"] == REDACTED
    assert data["db"] == f"postgres://{REDACTED}@db.example:5432/x"
    assert data["args"] == ["--api-key", REDACTED, "--port", "8000"]
    assert data["block"] == ["--hf-token", REDACTED]
    assert shlex.split(data["line"])[3:] == ["--api-key", REDACTED, "--max-num-batched-tokens", "2048"]
    assert data["header"] == f"Authorization: Bearer {REDACTED}"
    assert redact_text(out) == out and scan_text(out) == []

    doc = json.dumps({"env": {"HF_TOKEN": HF}, "argv": ["--token", PLAIN], "url": f"https://u:{DB}@h/"}, indent=2)
    loaded = json.loads(redact_text(doc))
    assert loaded == {"env": {"HF_TOKEN": REDACTED}, "argv": ["--token", REDACTED], "url": f"https://{REDACTED}@h/"}
    assert redact_argv(["python", "--api-key", PLAIN, f"--token={HF}"]) == [
        "python", "--api-key", REDACTED, f"--token={REDACTED}"]


def test_old_markers_still_count_as_clean(tmp_path: Path) -> None:
    old, url_old = OLD_MARKERS
    text = textwrap.dedent(f"""\
        Process 7: python --api-key {old} --port 8000
        HF_TOKEN={old}
        {{"VLLM_API_KEY": "{old}", "argv": ["--token", "{old}"]}}
        Authorization: Bearer {old}
        db at postgres://{url_old}@db.example/x and redis://:{url_old}@cache
        -----BEGIN RSA PRIVATE KEY----- {old}
        """)
    assert redact_text(text) == text and scan_text(text) == []
    assert redact_argv(["python", "--api-key", old]) == ["python", "--api-key", old]
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / "proc.txt").write_text(text)
    assert scan_tree(tmp_path) == []


def test_scenario_copy_in_a_bundle_loads_and_holds_no_secret(tmp_path: Path) -> None:
    scenario_text = textwrap.dedent(f"""\
        name: secrets-everywhere
        engines:
          - name: api
            kind: command
            command: [python3, -m, http.server, "{{port}}", --api-key, {PLAIN}, "--hf-token={HF}"]
            env:
              HF_TOKEN: {HF}
              DB_PASSWORD: {PLAIN}
              DATABASE_URL: postgres://admin:{DB}@db.example/x
              KVCACHED_IPC_NAME: API
          - name: vlm
            kind: vllm
            model: /models/tiny
            env: {{VLLM_API_KEY: {PLAIN}}}
            vllm:
              args: [--api-key, {PLAIN}, --max-num-batched-tokens, "2048"]
        """)
    scenario = parse_scenario(scenario_text, "secrets.yaml")
    bundle_dir = tmp_path / "bundle"
    bundle = Bundle()
    with LaunchedRun(scenario, scenario_text, bundle, bundle_dir, progress=lambda m: None):
        pass   # the scenario copy is written on entry; teardown with no engine launched
    copy = (bundle_dir / "scenario.yaml").read_text()
    for secret in (PLAIN, HF, DB):
        assert secret not in copy
    data = yaml.safe_load(copy)
    api, vlm = data["engines"]
    assert api["command"][4:] == ["--api-key", REDACTED, f"--hf-token={REDACTED}"]
    assert api["env"] == {"HF_TOKEN": REDACTED, "DB_PASSWORD": REDACTED,
                          "DATABASE_URL": f"postgres://{REDACTED}@db.example/x", "KVCACHED_IPC_NAME": "API"}
    assert vlm["env"] == {"VLLM_API_KEY": REDACTED}
    again = parse_scenario(copy, str(bundle_dir / "scenario.yaml"))   # kvdiag's own loader re-runs it
    assert again.engines[0].command[:4] == ["python3", "-m", "http.server", "{port}"]
    assert again.engines[1].vllm.args == ["--api-key", REDACTED, "--max-num-batched-tokens", "2048"]
    assert sum(bundle.redaction.files["scenario.yaml"].values()) == bundle.redaction.total == 7   # 7 values, 7 counted
    assert scan_tree(bundle_dir) == []
