"""No secret byte reaches an output folder, checked on real runs.

Real processes carry every secret-flag name and every credential shape on their command line
and in their environment: a plain Python process (`kvdiag capture --pid`) and a launched
engine (a simulated engine wrapped so that its own command line holds the secrets) run under
`kvdiag repro` and `kvdiag soak`. Every file under each output folder (raw tool outputs,
bundle.json, logs, reports) is searched for the secret bytes, `kvdiag redact DIR` says the
folder is clean, and the scanner finds a secret planted back into a copy.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kvcli import assert_one_raw_layout, read_report, run_kvdiag

from kvdiag.allocator import remove_device_files
from kvdiag.launch.engines import sim_argv
from kvdiag.ports import free_port
from kvdiag.redact.rules import REDACTED
from kvdiag.scenario.models import EngineSpec, SimParams

pytestmark = pytest.mark.timeout(400)


def _rand(n: int = 12) -> str:
    return secrets.token_hex(n)


def _secrets() -> dict[str, str]:
    """name -> a fresh secret value (unique bytes per test run)."""
    r = _rand
    return {
        # plain values: only the flag's (or variable's) name says they are secret
        "api_key": f"Pk{r()}", "hf_token_flag": f"Pt{r()}", "client_secret": f"Ps{r()}",
        "db_password": f"Pp{r()}", "passwd": f"Pw{r()}", "proxy_auth": f"Pa{r()}", "credential": f"Pc{r()}",
        "token_eq": f"Pe{r()}",
        # credential shapes under neutral flag names
        "hf": f"hf_{r(12)}", "sk": f"sk-proj-{r(12)}", "ghp": f"ghp_{r(18)}",
        "github_pat": f"github_pat_{r(14)}", "aws": "AKIA" + secrets.token_hex(8).upper(),
        "slack": f"xoxb-{secrets.randbelow(10**12):012d}-{r(8)}",
        "jwt": f"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ{r(8)}.{r(16)}",
        "bearer": f"Br{r()}", "url_user": f"u{r(4)}", "url_pass": f"Pu{r()}",
    }


def _argv_secrets(s: dict[str, str]) -> list[str]:
    return ["--api-key", s["api_key"], "--hf-token", s["hf_token_flag"], "--client-secret=" + s["client_secret"],
            "--db-password", s["db_password"], "--passwd=" + s["passwd"], "--proxy-auth", s["proxy_auth"],
            "--gcp-credential", s["credential"], "--token=" + s["token_eq"],
            "--x-hf", s["hf"], "--x-sk=" + s["sk"], "--x-gh", s["ghp"], "--x-pat", s["github_pat"],
            "--x-aws", s["aws"], "--x-slack", s["slack"], "--x-jwt", s["jwt"],
            "--x-header", f"Authorization: Bearer {s['bearer']}",
            "--x-db", f"postgres://{s['url_user']}:{s['url_pass']}@db.internal:5432/app"]


def _env_secrets(s: dict[str, str]) -> dict[str, str]:
    return {"HF_TOKEN": s["hf_token_flag"], "OPENAI_API_KEY": s["api_key"], "APP_CLIENT_SECRET": s["client_secret"],
            "DB_PASSWORD": s["db_password"], "SMTP_PASSWD": s["passwd"], "PROXY_AUTH": s["proxy_auth"],
            "GCP_CREDENTIALS": s["credential"], "SETTING_HF": s["hf"], "SETTING_SK": s["sk"],
            "SETTING_GH": s["ghp"], "SETTING_PAT": s["github_pat"], "SETTING_AWS": s["aws"],
            "SETTING_SLACK": s["slack"], "SETTING_JWT": s["jwt"], "SETTING_HDR": f"Bearer {s['bearer']}",
            "DATABASE_URL": f"postgres://{s['url_user']}:{s['url_pass']}@db.internal:5432/app",
            # variables the environment record collects (KVCACHED_*, VLLM_*, CUDA_*, HF_*)
            "VLLM_API_KEY": s["api_key"], "KVCACHED_NOTE": s["ghp"], "CUDA_NOTE": s["jwt"],
            "VLLM_HF_ENDPOINT": f"https://{s['url_user']}:{s['url_pass']}@hub.internal/x",
            "HF_HUB_HEADER": f"Bearer {s['bearer']}"}


def _needles(s: dict[str, str]) -> dict[str, bytes]:
    """What must not appear anywhere. The URL user name is not a secret; its password is."""
    return {k: v.encode() for k, v in s.items() if k != "url_user"}


def assert_no_secret_bytes(folder: Path, s: dict[str, str]) -> int:
    """Search every file under ``folder`` for every secret's bytes; returns how many files were read."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert files, f"{folder} is empty"
    leaks = []
    for path in files:
        data = path.read_bytes()
        leaks += [f"{path.relative_to(folder)}: {name}" for name, needle in _needles(s).items() if needle in data]
    assert not leaks, leaks
    return len(files)


def assert_scanner_clean_then_finds_planted(out: Path, tmp_path: Path, s: dict[str, str]) -> None:
    proc = run_kvdiag("redact", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    copy = tmp_path / f"copy-{out.name}"
    shutil.copytree(out, copy)
    target = next(iter(sorted((copy / "bundle" / "raw").rglob("*.txt"))))
    with target.open("a", encoding="utf-8") as fh:
        fh.write(f"\nplanted back: --hf-token {s['hf_token_flag']} and {s['ghp']}\n")
    proc = run_kvdiag("redact", str(copy))
    assert proc.returncode == 10, proc.stdout + proc.stderr
    rel = str(target.relative_to(copy))
    assert f"{rel}:" in proc.stdout and "secret_flag" in proc.stdout and "github" in proc.stdout
    assert s["hf_token_flag"] not in proc.stdout + proc.stderr and s["ghp"] not in proc.stdout + proc.stderr
    shutil.rmtree(copy)


def _check_summary(out: Path) -> None:
    report = read_report(out)
    red = report["redaction"]
    assert isinstance(red, dict) and red["total"] > 0 and red["by_kind"].get("secret_flag", 0) > 0, red
    html = (out / "report.html").read_text()
    assert 'id="redaction"' in html and "secret_flag" in html


@pytest.fixture
def secret_values() -> dict[str, str]:
    return _secrets()


@pytest.fixture
def python_target(secret_values: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    env = {"PATH": "/usr/bin:/bin", **_env_secrets(secret_values)}
    code = "import sys, time; print('ready', flush=True); time.sleep(300)"
    proc = subprocess.Popen([sys.executable, "-c", code, *_argv_secrets(secret_values)], env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _kvdiag_env(s: dict[str, str]) -> dict[str, str]:
    """kvdiag's own environment, with secrets in variables its environment record collects."""
    return {**os.environ, "HF_TOKEN": s["hf_token_flag"], "VLLM_API_KEY": s["api_key"],
            "VLLM_HF_ENDPOINT": f"https://{s['url_user']}:{s['url_pass']}@hub.internal/x",
            "KVCACHED_NOTE": s["ghp"], "CUDA_NOTE": s["jwt"], "VLLM_HEADER": f"Bearer {s['bearer']}"}


def test_capture_of_a_python_process_writes_no_secret(python_target: subprocess.Popen[str], tmp_path: Path,
                                                      secret_values: dict[str, str]) -> None:
    out = tmp_path / "capture"
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "capture", "--pid", str(python_target.pid), "--out",
                           str(out), "--timeout", "10"], capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).resolve().parents[2], env=_kvdiag_env(secret_values))
    assert proc.returncode in (0, 10), proc.stdout + proc.stderr
    # py-spy printed the command line, and it was captured redacted
    raw = (out / "bundle" / "raw" / str(python_target.pid))
    assert f"--api-key {REDACTED}" in (raw / "py-spy.txt").read_text()
    assert f"--api-key {REDACTED}" in (raw / "proc.txt").read_text()
    assert assert_one_raw_layout(out / "bundle") >= 2
    # report.json/html/md, bundle.json and the raw outputs of proc, py-spy and pystack (gdb only runs where
    # pystack read no native frames); every file under the folder is searched whatever the count
    assert {p.name for p in raw.iterdir()} >= {"proc.txt", "py-spy.txt", "pystack.txt"}
    assert assert_no_secret_bytes(out, secret_values) >= 7
    env = json.loads((out / "bundle" / "bundle.json").read_text())["environment"]["env"]
    # the target's kvcached/vLLM variables are recorded (environment record), their secrets redacted
    assert env["HF_TOKEN"] == env["VLLM_API_KEY"] == REDACTED and "KVCACHED_NOTE" in env, env
    for needle in _needles(secret_values).values():
        assert needle.decode() not in proc.stdout + proc.stderr
    _check_summary(out)
    assert_scanner_clean_then_finds_planted(out, tmp_path, secret_values)


_WRAPPER = textwrap.dedent("""\
    import sys
    from kvdiag.sim.api_server import main
    sys.exit(main(sys.argv[sys.argv.index("--") + 1:]))
""")


def _engine_scenario(tmp_path: Path, s: dict[str, str], *, stalls: bool, device: str) -> Path:
    """One command-kind engine: the simulated engine, its own command line full of secrets."""
    port = free_port()
    if stalls:   # the soak-hybrid engine: wedges under saturated load
        sim = SimParams(layers=16, kv_per_layer_mb=1984, page_size_mb=4, weights_gb=30, gpu_memory_utilization=0.95,
                        max_running=24, step_ms=5, extra_args=["--tokens-per-page", "8", "--max-model-len", "4096"])
        kv_env = {"KVCACHED_PAGE_SIZE_MB": "4", "KVCACHED_GPU_UTILIZATION": "0.95",
                  "KVCACHED_CONTIGUOUS_LAYOUT": "false", "KVCACHED_PAGE_PREALLOC_ENABLED": "true"}
    else:
        sim = SimParams()
        kv_env = {"KVCACHED_PAGE_PREALLOC_ENABLED": "false"}
    spec = EngineSpec(name="secretive", kind="sim", sim=sim, allocator="stock")
    sim_args = sim_argv(spec, port, device, 96)
    serve_at = sim_args.index("serve")
    command = [sys.executable, "-c", _WRAPPER, *_argv_secrets(s), "--", *sim_args[serve_at + 1:]]
    scenario = {
        "name": "secrets", "windows": {"stall_s": 5, "startup_timeout_s": 90, "timeout_s": 180, "kill_grace_s": 2},
        "device": {"name": device, "size_gb": 96},
        "capture": {"tools": ["proc", "py-spy", "pystack", "gdb"], "tool_timeout_s": 15,
                    "when": "stall" if stalls else "always"},
        "engines": [{"name": "secretive", "kind": "command", "command": command, "port": port,
                     "allocator": "external", "env": {**_env_secrets(s), **kv_env,
                                                      "PYTHONPATH": str(Path(__file__).resolve().parents[2])}}],
    }
    path = tmp_path / "secrets.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    return path


@pytest.fixture
def device() -> Iterator[str]:
    name = f"kvdiag-secrets-{uuid.uuid4().hex[:8]}"
    yield name
    remove_device_files(name)


def test_repro_of_a_launched_engine_writes_no_secret(tmp_path: Path, secret_values: dict[str, str],
                                                     device: str) -> None:
    scen = _engine_scenario(tmp_path, secret_values, stalls=False, device=device)
    out = tmp_path / "repro"
    proc = run_kvdiag("repro", "two-engine", "--scenario", str(scen), "--out", str(out), timeout=300)
    # the verdict on an idle engine is the analyzer's business; here: what was written
    assert proc.returncode in (0, 10), proc.stdout[-2000:] + proc.stderr[-3000:]
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    captured = [p for p in bundle["processes"] if "--api-key" in p["cmdline"]]
    assert captured, "the engine's own process was not captured"
    assert captured[0]["cmdline"][captured[0]["cmdline"].index("--api-key") + 1] == REDACTED
    assert any((out / "bundle" / "raw").rglob("py-spy.txt"))
    assert assert_one_raw_layout(out / "bundle") >= 2   # raw/<pid>/, as `kvdiag capture` writes
    assert (out / "bundle" / "scenario.yaml").is_file() and any((out / "bundle" / "logs").glob("*.log"))
    assert_no_secret_bytes(out, secret_values)
    _check_summary(out)
    assert_scanner_clean_then_finds_planted(out, tmp_path, secret_values)


def test_soak_of_a_launched_engine_writes_no_secret(tmp_path: Path, secret_values: dict[str, str],
                                                    device: str) -> None:
    scen = _engine_scenario(tmp_path, secret_values, stalls=True, device=device)
    out = tmp_path / "soak"
    proc = run_kvdiag("soak", "--scenario", str(scen), "--duration", "60", "--out", str(out), timeout=300)
    assert proc.returncode == 10, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert any((out / "bundle" / "raw").rglob("py-spy.txt")), "the stalled engine was not captured"
    assert assert_one_raw_layout(out / "bundle") >= 2   # raw/<pid>/, as `kvdiag capture` writes
    assert_no_secret_bytes(out, secret_values)
    _check_summary(out)
    assert_scanner_clean_then_finds_planted(out, tmp_path, secret_values)
