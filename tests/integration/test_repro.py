"""`kvdiag repro two-engine` and `kvdiag ab` end to end on simulated engines (real processes)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml
from kvcli import read_report, run_kvdiag

ROOT = Path(__file__).resolve().parents[2]
SECRETS = ["hf_QpLanted9SecretTokenValue12345", "sk-plantedOpenAIkey0123456789abcdef", "s3cr3tPassw0rdX"]


def _kvdiag(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return run_kvdiag(*args, timeout=timeout)


_report = read_report


def test_default_scenario_reproduces_gil_cycle_on_engine_two(tmp_path: Path) -> None:
    out = tmp_path / "stock"
    proc = _kvdiag("repro", "two-engine", "--out", str(out))
    assert proc.returncode == 10, proc.stderr[-3000:]
    report = _report(out)
    verdict = report["verdict"]
    assert isinstance(verdict, dict)
    assert verdict["kind"] == "gil_cycle" and verdict["engine"] == "vlm"
    roles = " ".join(str(e["role"]) for e in verdict["evidence"])
    frames = " ".join(" ".join(e["frames"]) for e in verdict["evidence"])
    assert "alloc_page" in frames and "map_pages" in frames and "GIL" in roles
    engines = {e["name"]: e for e in report["engines"]}  # type: ignore[union-attr]
    assert engines["coder"]["healthy"] is True and engines["vlm"]["healthy"] is False
    assert engines["vlm"]["banner"]["mem_size_per_layer_mb"] == 11
    assert engines["vlm"]["pids"]["engine_core"] != engines["vlm"]["pids"]["api_server"]
    # The capture targeted the EngineCore: its process evidence is in the bundle with that role.
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    core = [p for p in bundle["processes"] if p["role"] == "engine_core"]
    assert core and core[0]["pid"] == engines["vlm"]["pids"]["engine_core"]
    assert {t["tool"] for t in core[0]["tools"]} >= {"pystack", "py-spy", "proc"}
    assert (out / "report.html").stat().st_size > 1000 and (out / "report.md").exists()
    events = [e["event"] for e in report["timeline"]]  # type: ignore[union-attr]
    assert "stall onset (last progress)" in events and "verdict" in events


def test_fixed_allocator_starts_both(tmp_path: Path) -> None:
    out = tmp_path / "fixed"
    proc = _kvdiag("repro", "two-engine", "--allocator", "fixed", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(out)
    assert report["verdict"]["kind"] == "healthy"  # type: ignore[index]
    assert all(e["healthy"] for e in report["engines"])  # type: ignore[union-attr]


def test_prealloc_off_control_starts_both(tmp_path: Path) -> None:
    out = tmp_path / "off"
    proc = _kvdiag("repro", "two-engine", "--scenario", str(ROOT / "scenarios" / "two-engine-prealloc-off.yaml"),
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    banners = [e["banner"] for e in _report(out)["engines"]]  # type: ignore[union-attr]
    assert all(b["enable_prealloc"] is False for b in banners)


def test_ab_separates_stock_and_fixed(tmp_path: Path) -> None:
    out = tmp_path / "ab"
    proc = _kvdiag("ab", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(out)
    ab = report["ab"]
    assert isinstance(ab, dict) and ab["separated"] is True
    assert ab["stock"]["verdict"] == "gil_cycle" and ab["fixed"]["verdict"] == "healthy"


def test_planted_secrets_never_reach_the_output(tmp_path: Path) -> None:
    scen = yaml.safe_load((ROOT / "scenarios" / "two-engine.yaml").read_text())
    for eng in scen["engines"]:
        eng["env"].update({"HF_TOKEN": SECRETS[0], "OPENAI_API_KEY": SECRETS[1],
                           "HTTP_PROXY": f"http://user:{SECRETS[2]}@proxy.local:3128"})
    path = tmp_path / "secret.yaml"
    path.write_text(yaml.safe_dump(scen))
    out = tmp_path / "out"
    proc = _kvdiag("repro", "two-engine", "--scenario", str(path), "--out", str(out))
    assert proc.returncode == 10, proc.stderr[-3000:]
    leaks = []
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) > 5
    for p in files:
        data = p.read_bytes()
        leaks += [f"{p.relative_to(out)}: {s[:6]}..." for s in SECRETS if s.encode() in data]
    assert leaks == []
    assert not any(s in proc.stdout + proc.stderr for s in SECRETS)


def test_invalid_scenario_is_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines:\n  - name: a\n    colour: blue\n")
    proc = _kvdiag("repro", "two-engine", "--scenario", str(bad))
    assert proc.returncode == 2
    assert f"{bad}:3: engines[0].colour: unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr
    missing = _kvdiag("repro", "two-engine", "--scenario", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "not found" in missing.stderr and "Traceback" not in missing.stderr


def test_missing_engine_binary_is_exit_4(tmp_path: Path) -> None:
    scen = tmp_path / "cmd.yaml"
    scen.write_text("engines:\n  - name: x\n    kind: command\n    command: [/nonexistent/vllm, serve]\n")
    proc = _kvdiag("repro", "two-engine", "--scenario", str(scen), "--out", str(tmp_path / "o"))
    assert proc.returncode == 4, proc.stderr
    assert "command not found" in proc.stderr and "Traceback" not in proc.stderr
