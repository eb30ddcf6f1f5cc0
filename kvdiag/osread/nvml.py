"""GPU utilization and the processes on each GPU, sampled a few times over a window. Reading only, no policy.

A driver wedged by a kernel that never ends is exactly what a capture may meet, and an NVML call into it
can block; so the samples are taken in a child process (its own process group) that prints one JSON line
per snapshot, and the caller kills it at its bound and keeps the snapshots it already printed.

Sources, in order: nvidia-ml-py (``import pynvml``), optional: NVML itself ships with the driver, and the
binding reads a snapshot in a few milliseconds inside the child, where ``nvidia-smi`` costs a process
start and 0.1-0.5 s per query; kvdiag must install on hosts with no GPU, so the binding is an extra
(``kvdiag[gpu]``), never required. Else ``nvidia-smi --query-gpu`` and ``--query-compute-apps``.

Run as a script (standard library only, so it starts fast) it prints, per snapshot,
``{"t": s, "source": "pynvml"|"nvidia-smi", "devices": [{index, name, uuid, utilization_pct,
memory_used_mb, processes: [{pid, used_memory_mb}], processes_read}]}`` and, when nothing could be read,
one ``{"error": "..."}`` line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdiag.model.gpu import GpuReadings

SAMPLES = 3                 # at least two instants: "busy over the window", not "busy once"
INTERVAL_S = 0.5
SMI_TIMEOUT_S = 3.0         # one nvidia-smi query, inside the child
_SCRIPT = str(Path(__file__).resolve())
_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0")


def gpu_present() -> bool:
    """A GPU driver is visible here (a device node or nvidia-smi): worth starting a sampler for."""
    return any(os.path.exists(p) for p in _DEVICE_NODES) or shutil.which("nvidia-smi") is not None


# ---------------------------------------------------------------- in the child


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _Nvml:
    """One NVML session (nvidia-ml-py) for the child's whole run."""

    def __init__(self) -> None:
        import pynvml  # type: ignore[import-not-found]  # optional (kvdiag[gpu]); absent without a GPU

        self.nv: Any = pynvml
        pynvml.nvmlInit()

    def snapshot(self) -> list[dict[str, Any]]:
        nv = self.nv
        out: list[dict[str, Any]] = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            dev: dict[str, Any] = {"index": i, "name": _text(nv.nvmlDeviceGetName(h)), "uuid": None,
                                   "utilization_pct": None, "memory_used_mb": None, "processes": [],
                                   "processes_read": True}
            try:
                dev["uuid"] = _text(nv.nvmlDeviceGetUUID(h))
            except nv.NVMLError:
                pass
            try:
                dev["utilization_pct"] = int(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            except nv.NVMLError:
                pass
            try:
                dev["memory_used_mb"] = int(nv.nvmlDeviceGetMemoryInfo(h).used) // (1024 * 1024)
            except nv.NVMLError:
                pass
            try:
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    used = getattr(p, "usedGpuMemory", None)
                    dev["processes"].append({"pid": int(p.pid),
                                             "used_memory_mb": int(used) // (1024 * 1024) if used else None})
            except nv.NVMLError:
                dev["processes_read"] = False
            out.append(dev)
        return out

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass


def _num(field: str) -> int | None:
    try:
        return int(float(field))
    except ValueError:
        return None       # "[N/A]", "[Not Supported]"


def _smi(exe: str, query: str) -> list[list[str]]:
    proc = subprocess.run([exe, query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                          timeout=SMI_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"nvidia-smi {query} failed: {(proc.stderr or proc.stdout).strip()[:200]}")
    return [[f.strip() for f in line.split(",")] for line in proc.stdout.splitlines() if line.strip()]


def _smi_snapshot(exe: str) -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = []
    by_uuid: dict[str, dict[str, Any]] = {}
    for row in _smi(exe, "--query-gpu=index,name,uuid,utilization.gpu,memory.used"):
        if len(row) < 5 or _num(row[0]) is None:
            continue
        dev: dict[str, Any] = {"index": _num(row[0]), "name": row[1], "uuid": row[2] or None,
                               "utilization_pct": _num(row[3]), "memory_used_mb": _num(row[4]), "processes": [],
                               "processes_read": True}
        devices.append(dev)
        by_uuid[row[2]] = dev
    try:
        apps = _smi(exe, "--query-compute-apps=gpu_uuid,pid,used_memory")
    except (RuntimeError, subprocess.TimeoutExpired):
        for dev in devices:
            dev["processes_read"] = False
        return devices
    for row in apps:
        if len(row) >= 3 and row[0] in by_uuid and _num(row[1]) is not None:
            by_uuid[row[0]]["processes"].append({"pid": _num(row[1]), "used_memory_mb": _num(row[2])})
    return devices


def sample(count: int = SAMPLES, interval_s: float = INTERVAL_S) -> None:
    """Print ``count`` snapshots ``interval_s`` apart as JSON lines (runs in the child)."""
    errors: list[str] = []
    nvml: _Nvml | None = None
    try:
        nvml = _Nvml()
    except ImportError:
        errors.append("nvidia-ml-py (pynvml) is not installed")
    except Exception as exc:   # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        errors.append(f"pynvml: {type(exc).__name__}: {exc}")
    smi = shutil.which("nvidia-smi") if nvml is None else None
    if nvml is None and smi is None:
        errors.append("nvidia-smi is not on PATH")
        print(json.dumps({"error": "; ".join(errors)}), flush=True)
        return
    t0 = time.monotonic()
    try:
        for k in range(count):
            if k:
                time.sleep(max(0.0, t0 + k * interval_s - time.monotonic()))
            t = time.monotonic() - t0
            try:
                devices = nvml.snapshot() if nvml is not None else _smi_snapshot(smi or "nvidia-smi")
            except Exception as exc:   # one failed snapshot must not lose the others
                print(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)
                continue
            print(json.dumps({"t": round(t, 3), "source": "pynvml" if nvml is not None else "nvidia-smi",
                              "devices": devices}), flush=True)
    finally:
        if nvml is not None:
            nvml.close()


# ---------------------------------------------------------------- in the caller


def parse_lines(text: str, note: str = "") -> GpuReadings:
    """The child's JSON lines as :class:`GpuReadings` (lines cut off by a kill are skipped)."""
    from kvdiag.model.gpu import GpuReadings, GpuSnapshot  # here: this file also runs as a standard-library script

    snaps: list[GpuSnapshot] = []
    errors: list[str] = []
    source = "none"
    for line in text.splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if "error" in data:
            errors.append(str(data["error"]))
            continue
        source = data.get("source", source)
        snaps.append(GpuSnapshot.model_validate({"t": data["t"], "devices": data.get("devices", [])}))
    notes = [n for n in (note, *errors) if n]
    return GpuReadings(source=source if snaps else "none", snapshots=snaps, note="; ".join(notes))


class GpuSampler:
    """A child that samples the GPUs ``count`` times, ``interval_s`` apart, started now; :meth:`result`
    collects it within a bound and :meth:`stop` ends it (both idempotent)."""

    def __init__(self, count: int = SAMPLES, interval_s: float = INTERVAL_S) -> None:
        self.bound_s = count * interval_s + 2 * SMI_TIMEOUT_S
        self._proc: subprocess.Popen[str] | None = None
        self._started = time.monotonic()
        self._error = ""
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", _SCRIPT, str(count), str(interval_s)], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        except OSError as exc:
            self._error = f"GPU sampler could not start: {exc}"

    def result(self, wait_s: float | None = None) -> GpuReadings:
        """What the child printed, waiting at most ``wait_s`` (default: what is left of its bound)."""
        from kvdiag.model.gpu import GpuReadings

        if self._proc is None:
            return GpuReadings(note=self._error)
        left = self.bound_s - (time.monotonic() - self._started) if wait_s is None else wait_s
        note = ""
        try:
            out, _ = self._proc.communicate(timeout=max(0.1, left))
        except subprocess.TimeoutExpired:
            self.stop()
            out, _ = self._proc.communicate(timeout=5)
            note = f"GPU sampler stopped after {time.monotonic() - self._started:.1f}s (driver slow or wedged?)"
        return parse_lines(out or "", note)

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


if __name__ == "__main__":
    sample(int(sys.argv[1]) if len(sys.argv) > 1 else SAMPLES,
           float(sys.argv[2]) if len(sys.argv) > 2 else INTERVAL_S)
