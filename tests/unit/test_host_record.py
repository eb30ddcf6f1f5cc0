"""One host record for every command: an aarch64 bundle's syscall numbers are read with aarch64's table,
whichever command wrote it (repro, capture) and when it is analyzed again (kvdiag analyze)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from kvdiag.analyze.diagnosis import diagnose
from kvdiag.bundle.io import load_bundle, save_bundle
from kvdiag.environment.host import host_record
from kvdiag.model.bundle import Bundle
from kvdiag.model.environment import EnvironmentRecord, HostRecord
from kvdiag.model.kinds import ProcessRole
from kvdiag.osread.syscall import SYSCALLS
from kvdiag.runs.capture import core_decides
from kvdiag.runs.lifecycle import new_bundle

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"
# x86_64 -> aarch64 numbers of the syscalls the fixture's threads are blocked in (futex, recvfrom).
X86_TO_ARM = {202: 98, 45: 207}


def _aarch64_evidence() -> Bundle:
    """A blocked IPC read captured on aarch64: its threads' syscall numbers are aarch64's, and the kernel
    showed no wchan, so the numbers alone say what each thread waits in."""
    bundle = load_bundle(BUNDLES / "ipc_read")[0]
    for proc in bundle.processes:
        for t in proc.threads:
            t.wchan = None
            if t.syscall_nr in X86_TO_ARM:
                nr = X86_TO_ARM[t.syscall_nr]
                assert t.syscall is not None
                t.syscall = " ".join([str(nr)] + t.syscall.split()[1:])
                t.syscall_nr = nr
    assert 207 in SYSCALLS["aarch64"]["read"] and 207 not in SYSCALLS["x86_64"]["read"]
    return bundle


@pytest.fixture
def on_aarch64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")


def test_an_aarch64_bundle_gets_one_verdict_from_repro_capture_and_analyze(on_aarch64: None,
                                                                          tmp_path: Path) -> None:
    evidence = _aarch64_evidence()
    # repro, ab and soak: the run's bundle header
    repro = new_bundle("repro")
    assert repro.host == host_record() and repro.host.machine == "aarch64"
    repro.processes, repro.findings = evidence.processes, evidence.findings
    by_repro = diagnose(repro).verdict
    # capture: the bundle's host, and the early "the EngineCore decides" judgement
    captured = evidence.model_copy(update={"host": host_record()}, deep=True)
    by_capture = diagnose(captured).verdict
    cited = {item.pid for item in by_capture.evidence}
    for proc in captured.processes:
        proc.role = ProcessRole.ENGINE_CORE if proc.pid in cited else proc.role
    assert core_decides(captured.processes, captured.findings) == (
        f"the EngineCore's evidence decided ({by_capture.kind.value})")
    # analyze: the saved bundle read back
    save_bundle(captured, tmp_path / "bundle")
    by_analyze = diagnose(load_bundle(tmp_path / "bundle")[0]).verdict

    assert by_repro.kind.value == by_capture.kind.value == by_analyze.kind.value == "blocked_ipc_read"
    # Read as x86_64 (the fallback for a bundle with no machine), the same numbers say something else.
    assert diagnose(evidence.model_copy(update={"host": HostRecord()})).verdict.kind.value != "blocked_ipc_read"


def test_bundles_written_before_the_record_was_typed_still_load() -> None:
    old_repro = {"hostname": "gh200-node-3", "platform": "Linux-6.8.0-aarch64-with-glibc2.39",
                 "python": "3.11.9", "cpus": "72"}
    old_capture = {"machine": "aarch64", "kernel": "6.8.0", "system": "Linux", "python": "3.11.9", "cpus": "72"}
    env = EnvironmentRecord(machine="aarch64").model_dump(mode="json")
    # repro's bundles named no machine: the environment record's is the one they ran on
    repro = Bundle.model_validate({"command": "repro", "host": old_repro, "environment": env})
    capture = Bundle.model_validate({"command": "capture --pid 1", "host": old_capture})
    assert repro.host == HostRecord(machine="aarch64", python="3.11.9", cpus=72)
    assert capture.host == HostRecord(machine="aarch64", system="Linux", kernel="6.8.0", python="3.11.9", cpus=72)
    assert Bundle.model_validate({"host": {"cpus": ""}}).host.cpus is None
