"""The one reading of kvcached's ``KVCACHED_*`` pool settings, as kvcached reads them.

Unset (or blank) leaves kvcached's default; ``KVCACHED_PAGE_PREALLOC_ENABLED`` enables prealloc only for
the word "true" (any case); a malformed number is named in ``errors`` and left unset. The allocator,
the simulated engine, doctor and sweep read the variables through here; what an engine is launched with
(the scenario's settings, its flags) is :func:`kvdiag.launch.engines.launched_pool`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

PREALLOC = "KVCACHED_PAGE_PREALLOC_ENABLED"
MIN_RESERVED = "KVCACHED_MIN_RESERVED_PAGES"
MAX_RESERVED = "KVCACHED_MAX_RESERVED_PAGES"
GPU_UTILIZATION = "KVCACHED_GPU_UTILIZATION"
PAGE_SIZE_MB = "KVCACHED_PAGE_SIZE_MB"
CONTIGUOUS_LAYOUT = "KVCACHED_CONTIGUOUS_LAYOUT"
# kvcached's defaults (kvcached/utils.py) for what a setting left unset means.
DEFAULT_PAGE_SIZE_MB = 2
DEFAULT_GPU_UTILIZATION = 0.95

_N = TypeVar("_N", int, float)


@dataclass(frozen=True)
class PoolSettings:
    """kvcached's pool settings as one environment gives them (None: unset, kvcached's default applies)."""

    prealloc: bool | None = None              # KVCACHED_PAGE_PREALLOC_ENABLED
    min_reserved_pages: int | None = None     # kvcached's default 5
    max_reserved_pages: int | None = None     # kvcached's default 10
    gpu_utilization: float | None = None      # kvcached's default 0.95
    page_size_mb: int | None = None           # kvcached's default 2
    contiguous_layout: bool | None = None     # "1", "true", "yes" or "on" is on
    errors: tuple[str, ...] = ()      # "invalid NAME='x': expected an integer", one per malformed variable

    @property
    def prealloc_on(self) -> bool:
        """Prealloc as kvcached runs it: on unless the variable says otherwise."""
        return True if self.prealloc is None else self.prealloc

    def pages_per_layer(self, kv_per_layer_mb: float, page_size_mb: int = DEFAULT_PAGE_SIZE_MB) -> int:
        """Whole pages in one layer's KV memory (kvcached floors mem_size_per_layer / page_size);
        ``page_size_mb``: the page size when the settings give none."""
        page = self.page_size_mb if self.page_size_mb is not None else page_size_mb
        return int(kv_per_layer_mb * 1024 * 1024) // (page * 1024 * 1024) if page > 0 else 0


def _number(env: Mapping[str, str], name: str, kind: Callable[[str], _N], what: str,
            errors: list[str]) -> _N | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return kind(raw)
    except ValueError:
        errors.append(f"invalid {name}={raw!r}: expected {what}")
        return None


def read_settings(env: Mapping[str, str]) -> PoolSettings:
    """kvcached's pool settings in ``env`` (an engine's environment)."""
    errors: list[str] = []
    prealloc = env.get(PREALLOC)
    contiguous = env.get(CONTIGUOUS_LAYOUT)
    return PoolSettings(
        prealloc=None if prealloc is None else prealloc.strip().lower() == "true",
        min_reserved_pages=_number(env, MIN_RESERVED, int, "an integer", errors),
        max_reserved_pages=_number(env, MAX_RESERVED, int, "an integer", errors),
        gpu_utilization=_number(env, GPU_UTILIZATION, float, "a number", errors),
        page_size_mb=_number(env, PAGE_SIZE_MB, int, "an integer", errors),
        contiguous_layout=(contiguous.strip().lower() in ("1", "true", "yes", "on")
                           if contiguous is not None and contiguous.strip() else None),
        errors=tuple(errors))
