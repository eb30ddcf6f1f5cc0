"""The environment record: facts of this host, redaction, ptrace judgement."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvdiag.environment import collect_environment
from kvdiag.environment.host import relevant_env
from kvdiag.environment.ptrace import judge
from kvdiag.model.environment import EnvironmentRecord, PtraceAccess
from kvdiag.redact.rules import REDACTED


def test_record_of_this_host_round_trips() -> None:
    rec = collect_environment(runtime=False)
    assert rec.python and rec.kernel == os.uname().release and rec.os
    assert rec.packages.get("kvdiag") and "vllm" in rec.packages and "torch" in rec.packages
    assert rec.cpus and rec.cpus >= 1 and rec.memory_total_mb and rec.memory_total_mb > 0
    assert rec.ptrace.uid == os.getuid()
    if not rec.gpus:   # this CI machine: says so in words
        assert rec.gpu_note.startswith("no GPU")
    assert EnvironmentRecord.model_validate_json(rec.model_dump_json()) == rec


def test_variables_in_effect_are_chosen_and_redacted() -> None:
    env = relevant_env({"KVCACHED_PAGE_PREALLOC_ENABLED": "true", "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz123456",
                        "VLLM_API_KEY": "s3cret-value", "HOME": "/root", "ENABLE_KVCACHED": "1",
                        "CUDA_VISIBLE_DEVICES": "0", "VLLM_USE_V1": "1"})
    assert env["KVCACHED_PAGE_PREALLOC_ENABLED"] == "true" and env["ENABLE_KVCACHED"] == "1"
    assert env["HF_TOKEN"] == REDACTED and env["VLLM_API_KEY"] == REDACTED
    assert "HOME" not in env and list(env) == sorted(env)


@pytest.mark.parametrize(("scope", "cap", "container", "refused", "fix_has"), [
    (0, False, None, False, None),
    (1, False, None, True, "ptrace_scope=0"),
    (1, True, None, False, None),
    (1, False, "docker", True, "--cap-add=SYS_PTRACE"),
    (2, False, "kubernetes", True, "SYS_PTRACE"),
    (2, True, None, False, None),
    (3, True, None, True, "reboot"),
    (None, False, None, False, None),    # no Yama: same-uid attach is allowed
])
def test_ptrace_judgement(scope: int | None, cap: bool, container: str | None, refused: bool,
                          fix_has: str | None) -> None:
    acc = judge(PtraceAccess(yama_ptrace_scope=scope, cap_sys_ptrace=cap, container=container, uid=1000))
    assert (acc.problem is not None) is refused
    assert acc.attach_children is (not refused)
    if fix_has:
        assert acc.fix is not None and fix_has in acc.fix


def test_ptrace_facts_match_proc() -> None:
    acc = collect_environment(gpus=False, runtime=False).ptrace
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    assert acc.yama_ptrace_scope == (int(yama.read_text()) if yama.exists() else None)
    cap_eff = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff"))
    assert acc.cap_sys_ptrace is bool(int(cap_eff.split()[1], 16) >> 19 & 1)


def test_gpus_read_through_nvidia_smi_in_a_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nvidia-smi path of the bounded GPU query (CI has no GPU: a stand-in prints nvidia-smi's CSV)."""
    import importlib.util

    if importlib.util.find_spec("cuda") is not None:
        pytest.skip("cuda-python is installed: it is asked first")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H200, 143771, 4000, 570.124.06'\n"
                   "echo '1, NVIDIA H200, 143771, 140000, 570.124.06'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    from kvdiag.osread.gpu import read_gpus

    driver, runtime, gpus, note = read_gpus(timeout_s=60)
    assert driver == "570.124.06" and runtime is None and note == "read with nvidia-smi"
    assert [(g.index, g.name, g.total_mb, g.free_mb) for g in gpus] == [
        (0, "NVIDIA H200", 143771, 4000), (1, "NVIDIA H200", 143771, 140000)]


def test_a_host_with_nothing_to_ask_starts_no_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cuda-python and no nvidia-smi: the answer the child would give, without starting it."""
    import importlib.util

    import kvdiag.osread.child as child
    from kvdiag.osread.gpu import query, read_gpus

    if importlib.util.find_spec("cuda") is not None:
        pytest.skip("cuda-python is installed: the child asks it")
    monkeypatch.setenv("PATH", str(tmp_path))        # an empty folder: no nvidia-smi

    def no_child(*_a: object, **_k: object) -> None:
        raise AssertionError("a child was started")

    monkeypatch.setattr(child, "run_bounded", no_child)
    driver, runtime, gpus, note = read_gpus(timeout_s=60)
    assert (driver, runtime, gpus) == (None, None, []) and note == query()["note"]
    assert note.startswith("no GPU: cuda-python is not installed and nvidia-smi is not on PATH"), note


def test_gpu_query_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wedged driver (here: an nvidia-smi that never answers) costs the timeout, not the run."""
    import importlib.util

    if importlib.util.find_spec("cuda") is not None:
        pytest.skip("cuda-python is installed: it is asked first")
    # A duration of its own, so a concurrent run of this test elsewhere is never mistaken for ours.
    stamp = f"61.{os.getpid() % 10000:04d}"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexec sleep {stamp}\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    from kvdiag.osread.gpu import read_gpus

    _, _, gpus, note = read_gpus(timeout_s=3)
    assert gpus == [] and "did not answer within 3s" in note

    def stuck() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == f"sleep\x00{stamp}\x00".encode():
                    found.append(pid)
            except OSError:
                continue
        return found

    # SIGKILL is delivered asynchronously: allow the killed process a bounded moment to go.
    deadline = time.monotonic() + 5
    left = stuck()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = stuck()
    assert left == [], "the stuck nvidia-smi outlived the query"


def test_variables_of_a_captured_engine_are_its_own() -> None:
    """`kvdiag capture` records the target's variables (from /proc/PID/environ), redacted."""
    import subprocess
    import sys

    env = {"PATH": os.environ.get("PATH", ""), "KVCACHED_PAGE_PREALLOC_ENABLED": "false",
           "KVCACHED_IPC_NAME": "VLMM", "HF_TOKEN": "hf_" + "q" * 34}
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('READY', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "READY"
        rec = collect_environment(gpus=False, runtime=False, target_pid=child.pid)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
        if child.stdout:
            child.stdout.close()
    assert rec.env_source == f"pid {child.pid}"
    assert rec.env["KVCACHED_PAGE_PREALLOC_ENABLED"] == "false" and rec.env["KVCACHED_IPC_NAME"] == "VLMM"
    assert rec.env["HF_TOKEN"] == REDACTED
    gone = collect_environment(gpus=False, runtime=False, target_pid=child.pid)
    assert gone.env_source == "kvdiag" and any("not readable" in e for e in gone.errors)
