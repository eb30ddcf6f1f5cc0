"""GPUs, CUDA driver and runtime versions, read in a child process with a time bound.

A wedged driver (exactly what a hung engine may be sitting on) must not wedge
kvdiag, so the query runs in a child Python under a timeout. It uses
cuda-python when importable (optional), else ``nvidia-smi``.
Reading free memory through the driver creates a primary context on each GPU
for a moment; ``nvidia-smi`` needs none.

Run as a module it prints one JSON object:
``{"driver": str|null, "runtime": str|null, "gpus": [{index,name,total_mb,free_mb}], "note": str}``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdiag.model.environment import GpuInfo

QUERY_TIMEOUT_S = 20.0
# The child runs this file as a script: standard library only, so it starts fast (no pydantic).
_SCRIPT = str(Path(__file__).resolve())


def _version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _import_first(*names: str) -> ModuleType | None:
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _via_cuda_python() -> dict[str, Any] | None:
    cu = _import_first("cuda.bindings.driver", "cuda.cuda")   # cuda-python >= 12.6, then older
    if cu is None:
        return None
    out: dict[str, Any] = {"driver": None, "runtime": None, "gpus": [], "note": "read with cuda-python"}
    try:
        rt = _import_first("cuda.bindings.runtime", "cuda.cudart")
        err, ver = rt.cudaRuntimeGetVersion() if rt is not None else (1, 0)
        if int(err) == 0:
            out["runtime"] = _version(int(ver))
    except Exception:
        pass
    (err,) = cu.cuInit(0)
    if int(err) != 0:
        out["note"] = f"no GPU: cuInit failed ({err})"
        return out
    err, ver = cu.cuDriverGetVersion()
    if int(err) == 0:
        out["driver"] = _version(int(ver))
    err, count = cu.cuDeviceGetCount()
    for i in range(int(count) if int(err) == 0 else 0):
        err, dev = cu.cuDeviceGet(i)
        _, raw_name = cu.cuDeviceGetName(100, dev)
        name = bytes(raw_name).split(b"\0", 1)[0].decode(errors="replace")
        _, total = cu.cuDeviceTotalMem(dev)
        free_mb: int | None = None
        err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
        if int(err) == 0:
            try:
                cu.cuCtxPushCurrent(ctx)
                err, free, _tot = cu.cuMemGetInfo()
                if int(err) == 0:
                    free_mb = int(free) // (1024 * 1024)
                cu.cuCtxPopCurrent()
            finally:
                cu.cuDevicePrimaryCtxRelease(dev)
        out["gpus"].append({"index": i, "name": name, "total_mb": int(total) // (1024 * 1024), "free_mb": free_mb})
    if not out["gpus"]:
        out["note"] = "no GPU: the CUDA driver reports no devices"
    return out


def _via_nvidia_smi() -> dict[str, Any] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    proc = subprocess.run([exe, "--query-gpu=index,name,memory.total,memory.free,driver_version",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15)
    out: dict[str, Any] = {"driver": None, "runtime": None, "gpus": [], "note": "read with nvidia-smi"}
    if proc.returncode != 0:
        out["note"] = f"no GPU: nvidia-smi failed: {(proc.stderr or proc.stdout).strip()[:200]}"
        return out
    for line in proc.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            out["gpus"].append({"index": int(parts[0]), "name": parts[1], "total_mb": int(float(parts[2])),
                                "free_mb": int(float(parts[3]))})
        except ValueError:
            continue
        out["driver"] = parts[4]
    if not out["gpus"]:
        out["note"] = "no GPU: nvidia-smi lists no devices"
    return out


def query() -> dict[str, Any]:
    """What this process can see (runs in the child)."""
    errors: list[str] = []
    for probe in (_via_cuda_python, _via_nvidia_smi):
        try:
            got = probe()
        except Exception as exc:  # an odd driver/binding must not lose the rest
            errors.append(f"{probe.__name__.lstrip('_')}: {type(exc).__name__}: {exc}")
            continue
        if got is not None and (got["gpus"] or probe is _via_nvidia_smi):
            return got
        if got is not None:
            errors.append(got["note"])
    return _no_gpu(errors)


def _no_gpu(errors: list[str]) -> dict[str, Any]:
    dev = "present" if os.path.exists("/dev/nvidia0") else "absent"
    note = "no GPU: cuda-python is not installed and nvidia-smi is not on PATH" if not errors else \
        "no GPU: " + "; ".join(e.removeprefix("no GPU: ") for e in errors)
    return {"driver": None, "runtime": None, "gpus": [], "note": f"{note} (/dev/nvidia0 {dev})"}


def _nothing_to_ask() -> bool:
    """Neither probe of the child could run: no cuda-python on this interpreter's path (the child's, in
    isolated mode, is a part of it) and no nvidia-smi. A CPU host then needs no child Python at all."""
    return importlib.util.find_spec("cuda") is None and shutil.which("nvidia-smi") is None


def read_gpus(timeout_s: float = QUERY_TIMEOUT_S) -> tuple[str | None, str | None, list[GpuInfo], str]:
    """(driver, runtime, gpus, note), queried in a child process bounded by ``timeout_s``."""
    from kvdiag.osread.child import ChildTimeout, run_bounded  # here: this file also runs as a script

    if _nothing_to_ask():
        return None, None, [], str(_no_gpu([])["note"])
    try:
        # Its own process group, so that a timeout also ends an nvidia-smi it started.
        code, out, err = run_bounded([sys.executable, "-I", _SCRIPT], timeout_s)
    except OSError as exc:
        return None, None, [], f"GPU query could not start: {exc}"
    except ChildTimeout:
        return None, None, [], f"GPU query did not answer within {timeout_s:g}s (driver busy or wedged?)"
    try:
        data = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, None, [], f"GPU query failed (exit {code}): {err.strip()[-200:]}"
    from kvdiag.model.environment import GpuInfo

    gpus = [GpuInfo.model_validate(g) for g in data.get("gpus", [])]
    return data.get("driver"), data.get("runtime"), gpus, str(data.get("note", ""))


if __name__ == "__main__":
    json.dump(query(), sys.stdout)
    sys.stdout.write("\n")
