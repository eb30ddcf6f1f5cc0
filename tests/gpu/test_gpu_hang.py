"""On an NVIDIA GPU: a kernel that never ends is `gpu_kernel_hang`; long kernels that finish are not a hang.

Each program (tests/fixtures/hangers/gpu_spin.py, hanger_kit.GPU_KINDS) really spins on the GPU while its
host thread waits in a CUDA synchronization; `kvdiag capture --pid` runs as a user runs it (the installed
`kvdiag`, else `python -m kvdiag`), with whatever stack tools the host has (no gdb on the lent machines),
and the GPU sampler reads NVML or nvidia-smi. The forever kernels are captured once their log has been
quiet for longer than the stall window (a log line within it reads as progress). Skipped cleanly where
torch or a CUDA device is missing. $KVDIAG_GPU_RESULTS, when set, gets one JSON line per capture.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "hangers"))
import hanger_kit as hk  # noqa: E402

from kvdiag.defaults import STALL_WINDOW_S  # noqa: E402

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
# What the summary may name for each wait (the CUDA call the thread is parked in): .item() copies into
# pageable memory, so it waits in cudaMemcpyAsync itself or in the stream synchronize after it, unless the
# launch of the reduction it reads (`x.sum()`) is already held by the driver behind the kernel that never ends.
WAITS = {"sync": ("device synchronize",), "stream": ("stream synchronize",), "event": ("event synchronize",),
         "item": ("device-to-host copy", "stream synchronize", "kernel launch"), "gil": ("stream synchronize",)}


def kvdiag(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kvdiag")
    argv = [exe] if exe else [sys.executable, "-m", "kvdiag"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def capture(pid: int, out: Path) -> tuple[int, dict[str, object], dict[str, object], float]:
    t0 = time.monotonic()
    proc = kvdiag("capture", "--pid", str(pid), "--out", str(out))
    wall = time.monotonic() - t0
    report = json.loads((out / "report.json").read_text())
    bundle = json.loads((out / "bundle" / "bundle.json").read_text())
    assert proc.returncode in (0, 10), proc.stdout + proc.stderr
    return proc.returncode, report, bundle, wall


def record(kind: str, code: int, report: dict[str, object], bundle: dict[str, object], wall: float) -> None:
    path = os.environ.get("KVDIAG_GPU_RESULTS")
    if not path:
        return
    verdict = report["verdict"]
    assert isinstance(verdict, dict)
    procs = bundle.get("processes") or []
    gpu = next((p.get("gpu") for p in procs if isinstance(p, dict) and p.get("gpu")), None)
    tools = sorted({t["tool"] for p in procs if isinstance(p, dict) for t in p.get("tools", []) if t.get("ok")})
    with open(path, "a") as fh:
        fh.write(json.dumps({"kind": kind, "exit": code, "verdict": verdict.get("kind"),
                             "confidence": verdict.get("confidence"), "summary": verdict.get("summary"),
                             "capture_wall_s": round(wall, 2), "tools_ok": tools, "gpu": gpu,
                             "threads": _stacks(procs)}) + "\n")


def _stacks(procs: list[object]) -> list[dict[str, object]]:
    """Each thread's state and its stack as each tool read it (name and library only): what a verdict that
    came out wrong on the device was judged from."""
    out: list[dict[str, object]] = []
    for p in procs:
        if not isinstance(p, dict):
            continue
        for t in p.get("threads", []):
            by_tool = {tool: [f"{f['name']} ({f.get('library') or f.get('file') or ''})" for f in frames[:40]]
                       for tool, frames in (t.get("frames_by_tool") or {}).items()}
            out.append({"pid": p["pid"], "tid": t["tid"], "name": t.get("name"), "state": t.get("state"),
                        "wchan": t.get("wchan"), "syscall": t.get("syscall"), "gil": t.get("gil"),
                        "cpu_ticks_delta": t.get("cpu_ticks_delta"), "frames_by_tool": by_tool})
    return out


def _util(bundle: dict[str, object], pid: int) -> list[int]:
    procs = [p for p in bundle["processes"] if isinstance(p, dict) and p["pid"] == pid]  # type: ignore[union-attr]
    gpu = procs[0].get("gpu") if procs else None
    assert gpu, "no GPU readings in the bundle"
    return [d["utilization_pct"] for s in gpu["snapshots"] for d in s["devices"]
            if any(q["pid"] == pid for q in d["processes"])]


@pytest.mark.parametrize("wait", sorted(WAITS))
def test_a_kernel_that_never_ends_is_a_gpu_kernel_hang(wait: str, tmp_path: Path) -> None:
    kind = f"gpu_spin_{wait}"
    with hk.running(kind, bound_s=180, ready_timeout_s=400) as h:
        time.sleep(STALL_WINDOW_S + 1.5)      # the log quiet for longer than the stall window
        code, report, bundle, wall = capture(h.pid, tmp_path / "out")
    record(kind, code, report, bundle, wall)
    verdict = report["verdict"]
    assert isinstance(verdict, dict)
    assert code == 10 and verdict["kind"] == "gpu_kernel_hang", verdict
    summary = str(verdict["summary"])
    assert any(w in summary for w in WAITS[wait]) and "GPU 0" in summary, summary
    if wait == "gil":
        assert "holds the GIL while it waits" in summary, summary
    util = _util(bundle, h.pid)
    assert len(util) >= 2 and min(util) >= 50, util


def test_long_kernels_that_finish_are_not_a_hang(tmp_path: Path) -> None:
    with hk.running("gpu_long_kernel", bound_s=120, ready_timeout_s=400) as h:
        time.sleep(3.0)
        code, report, bundle, wall = capture(h.pid, tmp_path / "out")
        log = h.log_path.read_text() if h.log_path else ""
    record("gpu_long_kernel", code, report, bundle, wall)
    verdict = report["verdict"]
    assert isinstance(verdict, dict)
    assert "step 1: kernel finished" in log, log
    assert code == 0 and verdict["kind"] != "gpu_kernel_hang", verdict


def test_the_sampler_sees_the_spinning_process() -> None:
    from kvdiag.osread.nvml import GpuSampler

    with hk.running("gpu_spin_stream", bound_s=120, ready_timeout_s=400) as h:
        got = GpuSampler(count=3, interval_s=0.3).result()
    assert got.source in ("pynvml", "nvidia-smi") and len(got.snapshots) == 3, got
    mine = [d for s in got.snapshots for d in s.devices if any(p.pid == h.pid for p in d.processes)]
    assert len(mine) == 3 and all((d.utilization_pct or 0) >= 50 for d in mine), got
