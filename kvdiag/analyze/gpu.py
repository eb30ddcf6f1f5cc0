"""A host thread waiting on the GPU: a kernel that never finishes, or a stream that waits on nothing. Pure.

A thread parked in a CUDA synchronization (stream, event or device synchronize, a blocking device-to-host
copy such as ``tensor.item()`` / ``.cpu()``, a NCCL wait, a kernel launch the driver does not accept) for the
whole capture window waits for the GPU,
not for another host thread: whatever the host rules would say about it (a spin that looks like work, a
GIL it holds while others queue for it) is a consequence. What the GPU itself reported over the same
window decides which hang it is:

- busy at every sample (NVML utilization, the process listed on it): a kernel that never finishes
  (``gpu_kernel_hang``);
- idle at every sample: no kernel runs, so the wait is for something that never happens on the device
  (an event no stream records, a stream-wait on a value another process never writes, a peer that never
  joins a collective): a hang of unknown kind, named as such, never a kernel hang;
- not read (no NVML, no nvidia-smi, the sampler timed out): ``gpu_kernel_hang`` at low confidence. Both
  readings above are hangs at this wait, so calling it inconclusive (exit 6) would tell the user the engine
  may be fine when its stacks prove it is not; the lower confidence and its reason say which half is
  unproven.

The stacks must show the thread in the wait at two instants (two stack tools), or /proc must show it
asleep for the whole window, and the process must have written nothing (log, sockets, pipes) during the
window: a busy engine's main thread sits in a synchronize at most instants too, but it writes its outputs
after every step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvdiag.analyze import vocab as v
from kvdiag.analyze.classify import ThreadView, WaitKind
from kvdiag.analyze.evidence import frame_rows, item_of
from kvdiag.defaults import STALL_WINDOW_S
from kvdiag.model.evidence import Frame, ProcessEvidence, ThreadEvidence
from kvdiag.model.gpu import GpuDeviceReading, GpuReadings
from kvdiag.model.kinds import Confidence, ProcessRole, VerdictKind
from kvdiag.model.run import EngineRecord, Finding
from kvdiag.model.verdict import EvidenceItem, Verdict

BUSY_PCT = 50       # a kernel that spins forever reads 100; an engine between steps reads near 0
IDLE_PCT = 5

# (name fragment, what the thread waits for), matched innermost first: the CUDA API call the thread is in.
# libcuda's own frames are unnamed (stripped); its exported entry points and libcudart's keep their names.
CUDA_API_WAITS: tuple[tuple[str, str], ...] = (
    ("cuStreamSynchronize", "stream synchronize"),
    ("cudaStreamSynchronize", "stream synchronize"),
    ("cuEventSynchronize", "event synchronize"),
    ("cudaEventSynchronize", "event synchronize"),
    ("cuCtxSynchronize", "device synchronize"),
    ("cudaDeviceSynchronize", "device synchronize"),
    ("cuMemcpyDtoH", "device-to-host copy"),
    # Synchronous for pageable host memory: torch's .item() / .cpu() wait in it.
    ("cudaMemcpyAsync", "device-to-host copy"),
    ("cudaMemcpy", "device-to-host copy"),
    ("cuMemcpy", "device copy"),
    # A launch that does not return: the driver takes no more work from this thread while the kernel ahead
    # of it runs on (torch's `x.sum()` queued behind a kernel that never ends spins inside cuLaunchKernel).
    # Instantaneous in a healthy process, so only a persistent one counts (below).
    ("cuLaunchKernel", "kernel launch"),
    ("cudaLaunchKernel", "kernel launch"),
)
# torch / c10d frames that say what the wait is for (what the Python code asked).
TORCH_WAITS: tuple[tuple[str, str], ...] = (
    ("THPVariable_item", "tensor.item()"),
    ("_local_scalar_dense_cuda", "tensor.item() (a device-to-host copy of one scalar)"),
    ("THPVariable_tolist", "tensor.tolist()"),
    ("THPVariable_cpu", "tensor.cpu()"),
    ("THCPModule_cudaSynchronize", "torch.cuda.synchronize()"),
    ("THCPStream_synchronize", "torch.cuda.Stream.synchronize()"),
    ("THCPEvent_synchronize", "torch.cuda.Event.synchronize()"),
    ("CUDAEvent::synchronize", "torch.cuda.Event.synchronize()"),
    ("memcpy_and_sync", "a device-to-host copy (.cpu() / .to('cpu'))"),
    ("copy_kernel_cuda", "a device-to-host copy (.cpu() / .to('cpu'))"),
    ("WorkNCCL::wait", "a NCCL collective's wait"),
    ("WorkNCCL::synchronize", "a NCCL collective's wait"),
    ("device_synchronize", "device synchronize"),
    ("stream_synchronize", "stream synchronize"),
)
# Python frames (last path components, function) that are such a wait.
PY_WAITS: dict[tuple[str, str], str] = {
    ("cuda/__init__.py", "synchronize"): "torch.cuda.synchronize()",
    ("cuda/streams.py", "synchronize"): "torch.cuda.Stream/Event.synchronize()",
    ("cuda/streams.py", "Stream.synchronize"): "torch.cuda.Stream.synchronize()",
    ("cuda/streams.py", "Event.synchronize"): "torch.cuda.Event.synchronize()",
}


@dataclass(frozen=True)
class CudaWait:
    """Where one stack waits on the GPU."""

    api: int | None          # index of the CUDA API frame (cudaStreamSynchronize, ...)
    torch: int | None        # index of the torch/c10d frame that says what for
    python: int | None       # index of the innermost Python frame (the caller)
    what: str                # "stream synchronize", "event synchronize", ...
    asked: str | None        # "tensor.item()", "torch.cuda.synchronize()", ...

    @property
    def first(self) -> int:
        return min(i for i in (self.api, self.torch, self.python) if i is not None)


def _match(name: str, table: tuple[tuple[str, str], ...]) -> str | None:
    return next((what for frag, what in table if frag in name), None)


def _py_wait(f: Frame) -> str | None:
    if f.kind != "python":
        return None
    tail = "/".join((f.file or "").rsplit("/", 2)[-2:])
    return PY_WAITS.get((tail, f.name)) or PY_WAITS.get((tail, f.name.rsplit(".", 1)[-1]))


def cuda_wait(frames: list[Frame]) -> CudaWait | None:
    """The CUDA wait ``frames`` (innermost first) are parked in, if any: a CUDA API synchronization frame,
    a torch frame that blocks on the device, or a Python torch.cuda synchronize, inside the innermost
    Python frame (what the thread executes now, not a caller further out)."""
    first_py = next((i for i, f in enumerate(frames) if f.kind == "python"), None)
    native = frames[:first_py] if first_py is not None else frames
    api = next((i for i, f in enumerate(native) if _match(f.name, CUDA_API_WAITS)), None)
    # The outermost torch frame says what the Python code asked (THPVariable_item over memcpy_and_sync).
    torch = next((i for i in reversed(range(len(native))) if _match(native[i].name, TORCH_WAITS)), None)
    py = None
    if first_py is not None and _py_wait(frames[first_py]):
        py = first_py
    if api is None and torch is None and py is None:
        return None
    what = (_match(frames[api].name, CUDA_API_WAITS) if api is not None else None) or (
        _match(frames[torch].name, TORCH_WAITS) if torch is not None else None) or "synchronize"
    asked = (_match(frames[torch].name, TORCH_WAITS) if torch is not None else None) or (
        _py_wait(frames[py]) if py is not None else None)
    if asked == what:
        asked = None
    return CudaWait(api=api, torch=torch, python=_caller(frames, first_py), what=what, asked=asked)


def _caller(frames: list[Frame], first_py: int | None) -> int | None:
    """The innermost Python frame of the application (torch's own Python wrappers skipped)."""
    if first_py is None:
        return None
    return next((i for i in range(first_py, len(frames)) if frames[i].kind == "python"
                 and "/torch/" not in (frames[i].file or "")), first_py)


def _stacks(th: ThreadEvidence) -> dict[str, list[Frame]]:
    out = {tool: fs for tool, fs in th.frames_by_tool.items() if fs}
    if not out and th.frames:
        out["merged"] = th.frames
    return out


def _py_at(frames: list[Frame]) -> tuple[str, str, int | None] | None:
    """(function, file name, line) of the innermost Python frame."""
    f = next((f for f in frames if f.kind == "python"), None)
    if f is None:
        return None
    return f.name.rsplit(".", 1)[-1], (f.file or "").rsplit("/", 1)[-1], f.line


@dataclass
class _Waiter:
    view: ThreadView
    wait: CudaWait
    frames: list[Frame]
    tools: list[str]          # the stack tools whose own reading shows it in a CUDA wait
    tool: str | None = None   # whose stack ``frames`` is (None: the thread's own ThreadEvidence.frames)

    @property
    def persistent(self) -> bool:
        return len(self.tools) >= 2 or self.view.quiet is True


def _waiters(proc: ProcessEvidence, views: list[ThreadView]) -> list[_Waiter]:
    by_tid = {t.tid: t for t in proc.threads}
    out: list[_Waiter] = []
    for view in views:
        th = by_tid.get(view.tid)
        if th is None or view.idle_by_design:
            continue
        stacks = _stacks(th)
        seen = {tool: w for tool, fs in stacks.items() if (w := cuda_wait(fs)) is not None}
        if not seen:
            continue
        # The thread's own stack when it shows the wait, else the first tool's that does.
        tool = None if cuda_wait(th.frames) is not None else next(t for t in stacks if t in seen)
        frames = th.frames if tool is None else stacks[tool]
        wait = cuda_wait(frames)
        assert wait is not None
        # A Python-only sample (py-spy --nonblocking never pauses the target, so it reads no native frames)
        # agrees when it shows the thread on the same Python line that made the CUDA call.
        at = _py_at(frames)
        agree = [tool for tool, fs in stacks.items() if tool not in seen and at is not None
                 and not any(f.kind == "native" for f in fs) and _py_at(fs) == at]
        out.append(_Waiter(view, wait, frames, sorted(t for t in [*seen, *agree] if t != "merged"), tool))
    # The main thread first, then the one most tools agree on.
    return sorted(out, key=lambda w: (not w.persistent, not w.view.is_main, -len(w.tools), w.view.tid))


@dataclass(frozen=True)
class GpuState:
    """What the readings say about the GPUs this process uses."""

    state: str                       # "busy", "idle", "mixed", "unread"
    devices: list[int]               # the devices judged (the process's own, else all)
    listed: bool                     # the process is in a device's process list
    samples: int
    text: str                        # "GPU 0 (NVIDIA H100): 100 % at 3 samples over 1.0 s; pid 12 on it (900 MiB)"
    note: str = ""


def _dev_name(series: list[GpuDeviceReading]) -> str:
    name = next((d.name for d in series if d.name), "")
    return f"GPU {series[0].index}" + (f" ({name})" if name else "")


def gpu_state(gpu: GpuReadings | None, pid: int) -> GpuState:
    """Busy, idle or mixed over the window, for the GPUs ``pid`` has a context on (all GPUs when it is on
    none of the lists: a PID namespace, or processes the driver would not list)."""
    if gpu is None or not gpu.snapshots:
        why = gpu.note if gpu is not None and gpu.note else "no GPU readings were taken during the capture"
        return GpuState("unread", [], False, 0, "", why)
    indices = gpu.indices()
    mine = [i for i in indices if any(p.pid == pid for d in gpu.device_series(i) for p in d.processes)]
    devices = mine or indices
    parts: list[str] = []
    states: list[str] = []
    for i in devices:
        series = gpu.device_series(i)
        util = [d.utilization_pct for d in series if d.utilization_pct is not None]
        if not util:
            states.append("unread")
            parts.append(f"{_dev_name(series)}: utilization not reported")
            continue
        if len(util) >= 2 and all(u >= BUSY_PCT for u in util):
            states.append("busy")
        elif all(u <= IDLE_PCT for u in util):
            states.append("idle")
        elif len(util) < 2 and util[0] >= BUSY_PCT:
            states.append("busy_once")
        else:
            states.append("mixed")
        used = next((p.used_memory_mb for d in series for p in d.processes if p.pid == pid), None)
        on = f"; pid {pid} on it" + (f" ({used} MiB)" if used else "") if i in mine else ""
        pct = "/".join(str(u) for u in util)
        parts.append(f"{_dev_name(series)}: utilization {pct} % at {len(util)} sample(s) over "
                     f"{gpu.window_s:.1f}s{on}")
    if "busy" in states:
        state = "busy"
    elif "busy_once" in states:
        state = "busy_once"
    elif states and all(s == "idle" for s in states):
        state = "idle"
    elif states and all(s == "unread" for s in states):
        state = "unread"
    else:
        state = "mixed"
    judged = [i for i, s in zip(devices, states, strict=True) if s == state] or devices
    note = "" if mine else (f"pid {pid} is on no GPU's process list (another PID namespace, or the list was "
                            "not readable): every GPU of the host was judged")
    return GpuState(state, judged, bool(mine), len(gpu.snapshots), "; ".join(parts), note)


def _where_proc(proc: ProcessEvidence) -> str:
    role = {ProcessRole.ENGINE_CORE: "the EngineCore", ProcessRole.API_SERVER: "the API server",
            ProcessRole.WORKER: "a Worker"}.get(proc.role)
    if role is None:
        return f"pid {proc.pid}"
    return f"pid {proc.pid} ({role}{' of engine ' + proc.engine if proc.engine else ''})"


def _cite(w: _Waiter, role: str, engine: str | None) -> EvidenceItem:
    """The wait's frames from the CUDA call out to the second Python frame; key frames: the CUDA API call,
    the torch frame that says what for, the Python caller."""
    keys = {i for i in (w.wait.api, w.wait.torch, w.wait.python) if i is not None}

    def skip(i: int, f: Frame, past_python: bool) -> bool:
        key = i in keys
        return ((f.name in ("???", "??", "") and not key)
                or (f.kind != "python" and (past_python or (v.is_system_frame(f) and not key))))

    def text(f: Frame) -> str:
        return v.describe(f) + (f" `{f.source.strip()[:80]}`" if f.kind == "python" and f.source else "")

    rows = frame_rows(w.frames, w.wait.first, skip, text)
    return item_of(w.view.pid, w.view.tid, role, engine, rows, keys, tool=w.tool)


def _wait_phrase(w: _Waiter) -> str:
    api = w.frames[w.wait.api].name if w.wait.api is not None else None
    what = f"{w.wait.what}" + (f" ({v.short_name(api, components=1)})" if api else "")
    if w.wait.asked:
        what += f" for {w.wait.asked}"
    issuer = _issuer(w)
    if issuer is not None:
        what += f" issued by {v.describe(w.frames[issuer])}"
    if w.wait.python is not None:
        f = w.frames[w.wait.python]
        what += f" at {v.describe(f)}" + (f" `{f.source.strip()[:80]}`" if f.source else "")
    return what


def _issuer(w: _Waiter) -> int | None:
    """The application's own native frame that made the CUDA call (an extension's launch-and-sync), when
    the call did not come from torch itself."""
    if w.wait.api is None or w.wait.torch is not None:
        return None
    end = w.wait.python if w.wait.python is not None else len(w.frames)
    return next((i for i in range(w.wait.api + 1, end) if v.is_project_frame(w.frames[i])
                 and not v.is_binding_glue(w.frames[i]) and not w.frames[i].name.startswith("pybind11::")), None)


def _how_long(w: _Waiter) -> str:
    if len(w.tools) >= 2:
        return f"in the same wait in {len(w.tools)} stack samples ({', '.join(w.tools)})"
    return "asleep in it for the whole /proc sample window (no CPU, no wakeup)"


def _gil_behind(views: list[ThreadView], w: _Waiter) -> list[ThreadView]:
    """Python threads queued for the GIL the waiting thread holds."""
    if not w.view.holds_gil:
        return []
    return [t for t in views if t.kind is WaitKind.GIL_WAIT and t.tid != w.view.tid]


def _gil_waiter(t: ThreadView, engine: str | None) -> EvidenceItem:
    frames = t.frames[:8]
    gil = next((i for i, f in enumerate(frames) if v.matches(f.name, v.GIL_ACQUIRE, v.GIL_ACQUIRE_SUBSTR)), None)
    py = next((i for i, f in enumerate(frames) if f.kind == "python"), None)
    return item_of(t.pid, t.tid, "waits for the GIL the GPU waiter holds", engine,
                   [(i, v.describe(f)) for i, f in enumerate(frames)], {i for i in (gil, py) if i is not None})


def _moved(proc: ProcessEvidence) -> bool:
    """The process wrote during the window (its log, a socket, a pipe): something still comes out of it. An
    engine between steps writes its outputs; one stuck on the GPU writes nothing, while its input thread may
    still read new requests, so reads do not count."""
    p = proc.progress
    return p is not None and (any(n > 0 for n in p.log_growth.values())
                              or any(p.io_delta.get(k, 0) > 0 for k in ("wchar", "syscw")))


def _gpu_waiter(proc: ProcessEvidence, views: list[ThreadView]) -> _Waiter | None:
    if _moved(proc):
        return None
    found = [w for w in _waiters(proc, views) if w.persistent]
    return found[0] if found else None


def rule_gpu_kernel_hang(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    """A thread parked in a CUDA wait for the whole window while its GPU is busy (or the GPU was not read)."""
    w = _gpu_waiter(proc, views)
    if w is None:
        return None
    gs = gpu_state(proc.gpu, proc.pid)
    if gs.state not in ("busy", "busy_once", "unread"):
        return None     # idle or intermittent: not a kernel that never ends (rule_gpu_idle_wait, or no hang)
    behind = _gil_behind(views, w)
    reasons = [f"+ {w.view.label} {_how_long(w)}"]
    if gs.state == "unread":
        conf = Confidence.LOW
        reasons += [f"- the GPU was not read ({gs.note}): a kernel that never finishes and a stream waiting on "
                    "something that never happens look the same from the host; both are hangs at this wait"]
        device = "its GPU (not read: " + gs.note + ")"
    else:
        conf = Confidence.HIGH if gs.state == "busy" and gs.listed else Confidence.MEDIUM
        reasons.append(f"+ {gs.text}")
        if gs.state == "busy_once":
            reasons.append("- one GPU sample only: busy at that instant, not shown busy over the window")
        if gs.note:
            reasons.append(f"- {gs.note}")
        device = gs.text
    if proc.progress is not None:
        reasons.append(f"+ nothing written (log, sockets, pipes) over the {proc.progress.window_s:.2f}s window")
    gil = ""
    if behind:
        gil = (f"; it holds the GIL while it waits, so {len(behind)} Python thread(s) queue for the GIL behind it "
               f"({', '.join(t.label for t in behind[:3])}): the GIL wait is a consequence, the root is the "
               "GPU wait")
    evidence = [_cite(w, f"waits on the GPU: {w.wait.what}" + (" (holds the GIL)" if w.view.holds_gil else ""),
                      engine)]
    evidence += [_gil_waiter(t, engine) for t in behind[:3]]
    stream = (" (the kernel that runs is not visible in host stacks: its launch returned long before)"
              if w.wait.what != "kernel launch" else
              " (the launch waits behind a kernel already running on the device, which host stacks do not show)")
    summary = (f"GPU kernel hang in {_where_proc(proc)}: {w.view.label} waits in a CUDA {_wait_phrase(w)} "
               f"and never returns ({_how_long(w)}); {device}{gil}{stream}")
    return Verdict(kind=VerdictKind.GPU_KERNEL_HANG, confidence=conf, engine=engine, evidence=evidence,
                   summary=summary, confidence_reasons=reasons)


def rule_gpu_idle_wait(proc: ProcessEvidence, views: list[ThreadView], engine: str | None) -> Verdict | None:
    """A thread parked in a CUDA wait for the whole window while its GPU is idle at every sample: no kernel
    runs, so the wait is for a device-side event that never comes. A hang, not a kernel hang; the host rules
    run first (a host cycle elsewhere in the process is the more specific verdict)."""
    w = _gpu_waiter(proc, views)
    if w is None:
        return None
    gs = gpu_state(proc.gpu, proc.pid)
    if gs.state != "idle":
        return None
    reasons = [f"+ {w.view.label} {_how_long(w)}", f"+ {gs.text}", "- what the stream waits for is not visible "
               "from the host"]
    if gs.note:
        reasons.append(f"- {gs.note}")
    return Verdict(kind=VerdictKind.UNKNOWN, confidence=Confidence.MEDIUM, engine=engine, confidence_reasons=reasons,
                   evidence=[_cite(w, f"waits on an idle GPU: {w.wait.what}", engine)],
                   summary=(f"{_where_proc(proc)} is hung waiting on an idle GPU, not a kernel hang: {w.view.label} "
                            f"waits in a CUDA {_wait_phrase(w)} ({_how_long(w)}) while {gs.text}. No kernel runs, "
                            f"so the stream waits for something that never happens on the device (an event no "
                            f"stream records, a stream-wait on a value another process never writes, a peer that "
                            f"never joins a collective): a lost wakeup on the device side"))



# An HTTP server's access line (uvicorn: `"GET /health HTTP/1.1" 200`): a load balancer's probe writes it
# every few seconds whatever the engine does, so it says nothing about progress.
_ACCESS_LINE = re.compile(r'"(?:GET|POST|HEAD|PUT|DELETE) [^"]*" \d{3}')


def gpu_wait_progressed(name: str, hang: Verdict, e: EngineRecord | None) -> Verdict | None:
    """A GPU wait of a process whose log was written within the stall window before the capture (a bare
    capture reads the log's age): a long kernel in a loop that still advances, not a kernel that never
    ends, which a capture window shorter than one kernel cannot tell apart. Not a hang (yet); an
    access-log line (a health probe's) does not count as progress."""
    if hang.kind is not VerdictKind.GPU_KERNEL_HANG or e is None or e.log_idle_s is None:
        return None
    last = (e.last_log_line or "").strip()
    if e.log_idle_s > STALL_WINDOW_S or not last or _ACCESS_LINE.search(last):
        return None
    return Verdict(kind=VerdictKind.HEALTHY, confidence=Confidence.LOW, evidence=hang.evidence,
                   findings=[Finding(kind="gpu_wait", engine=e.name, message=hang.summary)],
                   confidence_reasons=[f"+ its log was written {e.log_idle_s:.1f}s before the capture",
                                       "- a thread waits on a busy GPU: one capture cannot tell a long kernel "
                                       "from one that never ends"],
                   summary=(f"{name}: not a hang (yet): a thread waits on the GPU, but the log was written "
                            f"{e.log_idle_s:.1f}s before the capture (`{last[:120]}`), within the "
                            f"{STALL_WINDOW_S:g}s stall window: a long kernel that still finishes. Capture again "
                            f"after {STALL_WINDOW_S:g}s without a log line to tell. {hang.summary}"))
