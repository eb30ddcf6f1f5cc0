"""Page allocators: the stock kvcached model, the fixed one, and a pure-Python twin.

``make_allocator("stock" | "fixed" | "reference", num_layers=..., mem_size_per_layer=...,
page_size=..., **kwargs)`` builds one. The native kinds live in ``kvdiag._native`` (C++, see
csrc/); the stock one deadlocks on purpose in kvcached #371's cycle.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any, cast

from kvdiag.allocator.protocol import ALLOCATOR_KINDS, PageAllocator
from kvdiag.allocator.reference import ReferenceAllocator
from kvdiag.errors import AllocatorError
from kvdiag.kvcached.settings import read_settings

__all__ = ["device_file_paths", "kvcached_env_kwargs", "make_allocator", "native_module", "remove_device_files"]

_BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e .` from the kvdiag checkout "
    "(needs a C++17 compiler, cmake, scikit-build-core and nanobind)"
)


def native_module() -> ModuleType:
    """Return ``kvdiag._native``; raise AllocatorError with a build hint if it is not built."""
    try:
        return importlib.import_module("kvdiag._native")
    except ImportError as exc:
        raise AllocatorError(f"the native allocator module kvdiag._native is not available: {exc}",
                             hint=_BUILD_HINT) from exc


def make_allocator(kind: str, **kwargs: Any) -> PageAllocator:
    """Build a page allocator of ``kind`` ("stock", "fixed" or "reference").

    kwargs are kvcached's PageAllocator arguments (num_layers, mem_size_per_layer, page_size,
    world_size, pp_rank, async_sched, contiguous_layout, enable_prealloc, num_kv_buffers,
    group_id, min_reserved_pages, max_reserved_pages, gpu_utilization) plus kvdiag's backend and
    bound options (backend, device_name, device_size, map_latency_us, wait_timeout_ms, ...).
    Invalid values raise ValueError naming the parameter.
    """
    if kind == "reference":
        return ReferenceAllocator(**kwargs)
    if kind not in ("stock", "fixed"):
        raise AllocatorError(f"unknown allocator kind {kind!r}",
                             hint=f"use one of {', '.join(ALLOCATOR_KINDS)}")
    # The reference-only knob is meaningless natively; the device model counts real usage.
    kwargs.pop("device_used_bytes", None)
    native = native_module()
    cls = native.StockPageAllocator if kind == "stock" else native.FixedPageAllocator
    try:
        num_layers = kwargs.pop("num_layers")
        mem_size_per_layer = kwargs.pop("mem_size_per_layer")
        page_size = kwargs.pop("page_size")
    except KeyError as exc:
        raise TypeError(f"make_allocator() missing required keyword argument {exc.args[0]!r}") from None
    return cast(PageAllocator, cls(num_layers, mem_size_per_layer, page_size, **kwargs))


def kvcached_env_kwargs(env: Mapping[str, str]) -> dict[str, Any]:
    """kvcached's environment variables (:func:`kvdiag.kvcached.settings.read_settings`) as allocator kwargs.

    Unset variables are left out so the allocator defaults (kvcached's) apply; a malformed one is a
    ValueError, as kvcached's own int() of it would be.
    """
    s = read_settings(env)
    if s.errors:
        raise ValueError("; ".join(s.errors))
    out: dict[str, Any] = {"enable_prealloc": s.prealloc, "min_reserved_pages": s.min_reserved_pages,
                           "max_reserved_pages": s.max_reserved_pages, "gpu_utilization": s.gpu_utilization,
                           "page_size": s.page_size_mb * 1024 * 1024 if s.page_size_mb is not None else None,
                           "contiguous_layout": s.contiguous_layout}
    return {k: v for k, v in out.items() if v is not None}


def device_file_paths(device_name: str) -> list[str]:
    """A modelled device's shared files (lock and accounting); [] without the native module (none made)."""
    try:
        native = native_module()
        return [native.device_lock_path(device_name), native.device_account_path(device_name)]
    except Exception:  # noqa: BLE001 - no native module: nothing was created
        return []


def remove_device_files(device_name: str) -> None:
    """Delete a modelled device's shared files (lock and accounting), the caller's own device, whose
    engines it has stopped."""
    for p in device_file_paths(device_name):
        try:
            os.unlink(p)
        except OSError:
            pass
