"""gpu_kernel_hang: stacks of torch processes parked in a CUDA wait (tests/fixtures/raw/gpu, the real formats of
pystack, py-spy and gdb) through kvdiag's parsers, with GPU readings in the NVML sampler's own format."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from kvdiag.analyze.diagnosis import diagnose
from kvdiag.analyze.engine_rules import engine_verdict
from kvdiag.analyze.gpu import cuda_wait
from kvdiag.analyze.process import analyze_process
from kvdiag.bundle.io import load_bundle, save_bundle
from kvdiag.capture.base import BackendResult
from kvdiag.capture.merge import merge_threads
from kvdiag.capture.parsers import parse_gdb, parse_pyspy, parse_pystack
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence, ProgressSample, ThreadEvidence, ToolRun
from kvdiag.model.gpu import GpuReadings
from kvdiag.model.kinds import Confidence, EnginePhase, ThreadState, VerdictKind
from kvdiag.model.run import EngineRecord
from kvdiag.osread.nvml import GpuSampler, parse_lines
from kvdiag.report import run_view, write_view

RAW = Path(__file__).resolve().parents[1] / "fixtures" / "raw" / "gpu"
PIDS = {"item_spin": 41230, "stream_sync_gil": 52001, "event_sync_blocking": 7301, "launch_blocked": 808}
# The waiting thread spins (CPU, no sleep) in the first two, sleeps in ioctl in the third.
SPINS = {"item_spin": True, "stream_sync_gil": True, "event_sync_blocking": False, "launch_blocked": True}
PARSERS = {"pystack": lambda t: parse_pystack(t)[0], "py-spy": lambda t: parse_pyspy(t)[0], "gdb": parse_gdb}


def tools_of(folder: str) -> tuple[str, ...]:
    return tuple(t for t in ("pystack", "py-spy", "gdb") if (RAW / folder / f"{t}.txt").is_file())


def readings(name: str, pid: int) -> GpuReadings:
    return parse_lines((RAW / f"nvml_{name}.jsonl").read_text().replace("PID", str(pid)))


def captured(folder: str, gpu: str | None = "busy", tools: tuple[str, ...] | None = None,
             log_growth: int = 0) -> ProcessEvidence:
    """The process as capture would record it: each tool's raw output parsed and merged, /proc's thread states
    over a 0.4 s window (the waiter spinning or asleep, the others asleep), the GPU readings."""
    pid = PIDS[folder]
    results = {t: BackendResult(tool=ToolRun(tool=t, ok=True),
                                threads=PARSERS[t]((RAW / folder / f"{t}.txt").read_text()))
               for t in tools or tools_of(folder)}
    tids = sorted({th.tid for r in results.values() for th in r.threads})
    proc_threads = [ThreadEvidence(tid=tid, state=ThreadState.RUNNING if tid == pid and SPINS[folder] else
                                   ThreadState.SLEEPING,
                                   cpu_ticks_delta=38 if tid == pid and SPINS[folder] else 0,
                                   ctx_switches_delta=400 if tid == pid and SPINS[folder] else 0) for tid in tids]
    results["proc"] = BackendResult(tool=ToolRun(tool="proc", ok=True), threads=proc_threads)
    return ProcessEvidence(pid=pid, threads=merge_threads(results), gpu=readings(gpu, pid) if gpu else None,
                           progress=ProgressSample(window_s=0.4, log_growth={"/srv/app/out.log": log_growth},
                                                   io_delta={"rchar": 4096}),
                           tools=[ToolRun(tool=t, ok=True) for t in results])


@pytest.mark.parametrize("folder", sorted(PIDS))
def test_every_tool_format_shows_the_cuda_wait(folder: str) -> None:
    for tool in tools_of(folder):
        threads = PARSERS[tool]((RAW / folder / f"{tool}.txt").read_text())
        main = next(t for t in threads if t.tid == PIDS[folder])
        if not any(f.kind == "native" for f in main.frames):
            continue    # py-spy without --native: the rule matches it to the native stacks by its Python line
        wait = cuda_wait(main.frames)
        assert wait is not None, (folder, tool, [f.name for f in main.frames[:12]])
        others = [cuda_wait(t.frames) for t in threads if t.tid != PIDS[folder]]
        assert others == [None] * len(others), (folder, tool)   # cuda-EvtHandlr's poll is not a wait on the GPU


def test_item_on_a_busy_gpu_is_a_kernel_hang() -> None:
    v = analyze_process(captured("item_spin"))
    assert v is not None and v.kind is VerdictKind.GPU_KERNEL_HANG and v.confidence is Confidence.HIGH
    assert "device-to-host copy (cudaMemcpyAsync) for tensor.item()" in v.summary
    assert "decode.py:54" in v.summary and "GPU 0 (NVIDIA H100 80GB HBM3)" in v.summary
    assert "pid 41230 on it (1022 MiB)" in v.summary and "3 stack samples" in v.summary
    ev = v.evidence[0]
    keys = [ev.frames[i] for i in ev.key_frames or []]
    assert any("cudaMemcpyAsync" in k for k in keys) and any("THPVariable_item" in k for k in keys)
    assert any("step (decode.py:54)" in k for k in keys)
    assert v.kind.exit_code == 10


def test_a_launch_queued_behind_a_kernel_that_never_ends() -> None:
    """Read on a lent H100 (tests/gpu, `--wait item`): `x.sum()` spins inside cuLaunchKernel, not in the
    synchronize of `.item()`; py-spy (Python frames only) agrees on the line."""
    v = analyze_process(captured("launch_blocked"))
    assert v is not None and v.kind is VerdictKind.GPU_KERNEL_HANG and v.confidence is Confidence.HIGH, v
    assert "kernel launch (cuLaunchKernel)" in v.summary and "gpu_spin.py:110" in v.summary, v.summary
    assert "2 stack samples (py-spy, pystack)" in v.summary, v.summary
    ev = v.evidence[0]
    keys = [ev.frames[i] for i in ev.key_frames or []]
    assert any("cuLaunchKernel" in k for k in keys) and any("gpu_spin.py:110" in k for k in keys), keys
    moving = analyze_process(captured("launch_blocked", log_growth=64))
    assert moving is None or moving.kind is not VerdictKind.GPU_KERNEL_HANG


def test_idle_gpu_is_not_a_kernel_hang() -> None:
    v = analyze_process(captured("item_spin", gpu="idle"))
    assert v is not None and v.kind is VerdictKind.UNKNOWN
    assert "not a kernel hang" in v.summary and "idle GPU" in v.summary and "utilization 0/0/0 %" in v.summary


def test_unread_gpu_is_a_low_confidence_kernel_hang_naming_why() -> None:
    for gpu in ("unread", None):
        v = analyze_process(captured("event_sync_blocking", gpu=gpu))
        assert v is not None and v.kind is VerdictKind.GPU_KERNEL_HANG and v.confidence is Confidence.LOW
        assert any(r.startswith("- the GPU was not read") for r in v.confidence_reasons), v.confidence_reasons
    assert "nvidia-smi is not on PATH" in v.summary or "no GPU readings" in v.summary


def test_gil_held_across_the_gpu_wait_names_the_gpu_as_the_root() -> None:
    v = analyze_process(captured("stream_sync_gil"))
    assert v is not None and v.kind is VerdictKind.GPU_KERNEL_HANG, v
    assert "stream synchronize (cudaStreamSynchronize)" in v.summary
    assert "holds the GIL while it waits" in v.summary and "the root is the GPU wait" in v.summary
    assert [e.tid for e in v.evidence] == [52001, 52019]


def test_blocking_event_sync_of_a_vllm_engine_core() -> None:
    v = analyze_process(captured("event_sync_blocking"))
    assert v is not None and v.kind is VerdictKind.GPU_KERNEL_HANG and v.confidence is Confidence.HIGH
    assert "event synchronize (cudaEventSynchronize) for torch.cuda.Event.synchronize()" in v.summary
    assert "gpu_model_runner.py:226" in v.summary


def test_one_sample_of_a_spinning_synchronize_is_an_ordinary_step() -> None:
    v = analyze_process(captured("item_spin", tools=("py-spy",)))
    assert v is None or v.kind is not VerdictKind.GPU_KERNEL_HANG


def test_a_log_that_grew_is_progress() -> None:
    v = analyze_process(captured("event_sync_blocking", log_growth=120))
    assert v is None or v.kind is not VerdictKind.GPU_KERNEL_HANG


def test_a_process_on_no_gpu_list_lowers_confidence() -> None:
    p = captured("item_spin")
    assert p.gpu is not None
    for snap in p.gpu.snapshots:
        snap.devices[0].processes = []
    v = analyze_process(p)
    assert v is not None and v.kind is VerdictKind.GPU_KERNEL_HANG and v.confidence is Confidence.MEDIUM
    assert any("no GPU's process list" in r for r in v.confidence_reasons)


def test_bundle_round_trip_and_reports(tmp_path: Path) -> None:
    """A bundle as capture writes it (raw files, bundle.json), loaded back, diagnosed and rendered."""
    proc = captured("stream_sync_gil")
    bdir = tmp_path / "out" / "bundle"
    for t in tools_of("stream_sync_gil"):
        dst = bdir / "raw" / str(proc.pid) / f"{t}.txt"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RAW / "stream_sync_gil" / f"{t}.txt", dst)
        next(r for r in proc.tools if r.tool == t).raw_path = f"raw/{proc.pid}/{t}.txt"
    save_bundle(Bundle(command="capture --pid 52001", processes=[proc]), bdir)
    bundle, _ = load_bundle(bdir)
    assert bundle.processes[0].gpu is not None and len(bundle.processes[0].gpu.snapshots) == 3
    bundle.diagnosis = diagnose(bundle)
    assert bundle.diagnosis.exit_code == 10
    out = tmp_path / "out"
    paths = write_view(out, run_view(bundle, bundle.diagnosis, out_dir=out, bundle_dir=bdir))
    report = json.loads(paths["report.json"].read_text())
    assert report["verdict"]["kind"] == "gpu_kernel_hang"
    assert "cudaStreamSynchronize" in report["verdict"]["summary"]
    page = paths["report.html"].read_text()
    assert "gpu_kernel_hang" in page and "cudaStreamSynchronize" in page
    assert "gpu_kernel_hang" in paths["report.md"].read_text()


def test_bundles_without_gpu_readings_still_load() -> None:
    old = {"pid": 5, "threads": []}
    assert ProcessEvidence.model_validate(old).gpu is None


# ---------------------------------------------------------------- the sampler (a real child process)


def test_parse_lines_keeps_what_a_killed_child_printed() -> None:
    text = (RAW / "nvml_busy.jsonl").read_text().replace("PID", "9")
    got = parse_lines(text + '{"t": 1.5, "devi', note="stopped")
    assert got.source == "pynvml" and len(got.snapshots) == 3 and got.window_s == 1.0 and got.note == "stopped"
    unread = parse_lines((RAW / "nvml_unread.jsonl").read_text())
    assert unread.source == "none" and not unread.snapshots and "nvidia-smi is not on PATH" in unread.note


def _fake_smi(tmp: Path, body: str) -> None:
    exe = tmp / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def test_sampler_reads_nvidia_smi_csv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # nvidia-smi's own CSV (noheader, nounits) for one busy GPU with one compute process.
    _fake_smi(tmp_path, 'case "$1" in\n'
              '  --query-gpu=*) echo "0, NVIDIA H100 80GB HBM3, GPU-5b1c2f0e, 100, 1540" ;;\n'
              '  --query-compute-apps=*) echo "GPU-5b1c2f0e, 4242, 1022" ;;\n'
              'esac\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    got = GpuSampler(count=2, interval_s=0.1).result()
    assert got.source in ("nvidia-smi", "pynvml"), got
    if got.source == "nvidia-smi":
        assert len(got.snapshots) == 2
        dev = got.snapshots[1].devices[0]
        assert (dev.index, dev.utilization_pct, dev.memory_used_mb) == (0, 100, 1540)
        assert [(p.pid, p.used_memory_mb) for p in dev.processes] == [(4242, 1022)]


def test_a_wedged_nvidia_smi_never_hangs_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, "exec sleep 60\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    sampler = GpuSampler(count=2, interval_s=0.1)
    t0 = time.monotonic()
    got = sampler.result(wait_s=1.0)
    assert time.monotonic() - t0 < 4.0
    if got.source != "pynvml":
        assert not got.snapshots and "stopped after" in got.note


@pytest.mark.parametrize(("idle_s", "last", "kind"), [
    (1.2, "step 12: kernel finished after 2.0 s", VerdictKind.HEALTHY),
    (1.2, 'INFO:     127.0.0.1:50312 - "GET /health HTTP/1.1" 200 OK', VerdictKind.GPU_KERNEL_HANG),
    (40.0, "step 12: kernel finished after 2.0 s", VerdictKind.GPU_KERNEL_HANG),
])
def test_a_log_written_within_the_stall_window_is_a_long_kernel(idle_s: float, last: str, kind: VerdictKind) -> None:
    """A bare capture reads how long ago the log was written: a loop of long kernels still logs each step."""
    proc = captured("item_spin")
    proc.engine = "e"
    e = EngineRecord(name="e", phase=EnginePhase.SERVING, last_log_line=last, log_tail=[last], log_idle_s=idle_s)
    v = engine_verdict("e", e, [proc], Bundle(engines=[e], processes=[proc]), [])
    assert v.kind is kind, v.summary
    if kind is VerdictKind.HEALTHY:
        assert "not a hang (yet)" in v.summary and "cudaMemcpyAsync" in v.summary
        assert any(f.kind == "gpu_wait" for f in v.findings)


def test_a_python_only_sample_on_the_same_line_confirms_the_wait() -> None:
    """py-spy --nonblocking (inside the /proc window) reads Python frames only: on the same line as the native
    stack's CUDA call, it is a second sample of the same wait."""
    proc = captured("item_spin", tools=("pystack", "py-spy"))
    main = next(t for t in proc.threads if t.tid == 41230)
    main.frames_by_tool["py-spy"] = [f for f in main.frames_by_tool["py-spy"] if f.kind == "python"]
    v = analyze_process(proc)
    assert v is not None and v.kind is VerdictKind.GPU_KERNEL_HANG, v
    assert "2 stack samples (py-spy, pystack)" in v.summary
    main.frames_by_tool["py-spy"][0] = main.frames_by_tool["py-spy"][0].model_copy(update={"line": 60})
    v = analyze_process(proc)
    assert v is None or v.kind is not VerdictKind.GPU_KERNEL_HANG   # it moved: another line


def test_a_process_that_writes_is_a_busy_engine_not_a_hang() -> None:
    """A serving engine's main thread waits on the GPU at most instants too; it writes its outputs every step."""
    proc = captured("event_sync_blocking")
    assert proc.progress is not None
    proc.progress.io_delta = {"rchar": 4096, "wchar": 1800, "syscw": 12}
    v = analyze_process(proc)
    assert v is None or v.kind is not VerdictKind.GPU_KERNEL_HANG


def test_a_nccl_watchdog_is_not_a_wait_on_the_gpu() -> None:
    from kvdiag.model.evidence import Frame

    frames = [Frame(name="std::condition_variable::wait_for", library="libstdc++.so.6"),
              Frame(name="c10d::ProcessGroupNCCL::Watchdog::runLoop()", library="libtorch_cuda.so"),
              Frame(name="c10d::ProcessGroupNCCL::Watchdog::run()", library="libtorch_cuda.so")]
    assert cuda_wait(frames) is None
