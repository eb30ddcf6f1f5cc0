"""Host facts: OS, kernel, Python, package versions, the environment in effect, CPU/memory limits.

Package versions come from installed metadata (importlib.metadata): nothing
heavy (torch, vLLM) is imported just to ask its version.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from kvdiag.model.environment import HostRecord
from kvdiag.osread.net import boot_id
from kvdiag.redact.rules import REDACTED, is_secret_name, redact_text

# The distributions a kvcached/vLLM bug report needs, by their PyPI names.
PACKAGES = ("vllm", "kvcached", "torch", "cuda-python", "flashinfer-python", "sglang", "pystack", "py-spy")
# Variables that change how kvcached or vLLM behave.
ENV_PREFIXES = ("KVCACHED_", "VLLM_", "CUDA_", "NCCL_", "PYTORCH_CUDA_", "TORCH_CUDA_", "HF_")
ENV_NAMES = frozenset({"ENABLE_KVCACHED", "NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD",
                       "PYTHONMALLOC", "OMP_NUM_THREADS"})


def os_name() -> str:
    """PRETTY_NAME from /etc/os-release, else platform's description."""
    try:
        for line in Path("/etc/os-release").read_text(encoding="utf-8").splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform(terse=True)


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version per distribution, None when it is not installed."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
        except Exception:  # a broken dist-info must not stop the record
            out[name] = None
    return out


def relevant_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The kvcached/vLLM/CUDA variables in ``environ``, secrets replaced (sorted by name)."""
    out: dict[str, str] = {}
    for key in sorted(environ):
        if key in ENV_NAMES or key.startswith(ENV_PREFIXES):
            value = environ[key]
            out[key] = REDACTED if (is_secret_name(key) and value) else redact_text(value)[:500]
    return out


def host_record() -> HostRecord:
    """This machine, as every bundle records it: what an offline reader needs to read its syscall numbers."""
    return HostRecord(machine=platform.machine(), system=platform.system(), kernel=platform.release(),
                      python=platform.python_version(), cpus=os.cpu_count(), boot_id=boot_id())
