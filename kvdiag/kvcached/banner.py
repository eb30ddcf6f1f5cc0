"""Parse kvcached's `Init C++ PageAllocator: ...` banner and assess its static deadlock risk.

The banner is printed by the C++ PageAllocator constructor (std::cout, so it
reaches stdout whatever the log level). Hybrid models print one per group_id.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvdiag.model.run import BannerInfo, BannerRisk

BANNER_MARKER = "Init C++ PageAllocator:"

_INT_FIELDS = {
    "num_layers": "num_layers",
    "mem_size_per_layer": "mem_size_per_layer_mb",
    "total_mem_size": "total_mem_size_mb",
    "page_size": "page_size_mb",
    "world_size": "world_size",
    "pp_rank": "pp_rank",
    "num_kv_buffers": "num_kv_buffers",
    "group_id": "group_id",
    "min_reserved_pages": "min_reserved_pages",
    "max_reserved_pages": "max_reserved_pages",
}
_BOOL_FIELDS = {
    "async_sched": "async_sched",
    "contiguous_layout": "contiguous_layout",
    "enable_prealloc": "enable_prealloc",
}
_KV = re.compile(r"(\w+)=(-?\d+)(?:MB)?")
# Defaults of kvcached's environment when a field is missing from an older banner.
_DEFAULTS: dict[str, int | bool] = {"min_reserved_pages": 5, "max_reserved_pages": 10, "group_id": 0,
                                    "pp_rank": 0, "world_size": 1, "num_kv_buffers": 2,
                                    "async_sched": False, "contiguous_layout": True}


def parse_banner(line: str, line_no: int | None = None, source: str | None = None) -> BannerInfo | None:
    """Return the banner on ``line`` or None when the line holds no (complete) banner."""
    idx = line.find(BANNER_MARKER)
    if idx < 0:
        return None
    body = line[idx + len(BANNER_MARKER):]
    values: dict[str, int] = {}
    for key, val in _KV.findall(body):
        try:
            values[key] = int(val)
        except ValueError:  # pragma: no cover - the regex only admits digits
            continue
    fields: dict[str, int | bool] = {}
    for key, attr in _INT_FIELDS.items():
        if key in values:
            fields[attr] = values[key]
    for key, attr in _BOOL_FIELDS.items():
        if key in values:
            fields[attr] = values[key] != 0
    for key, default in _DEFAULTS.items():
        attr = _INT_FIELDS.get(key) or _BOOL_FIELDS[key]
        fields.setdefault(attr, default)
    required = ("num_layers", "mem_size_per_layer_mb", "page_size_mb", "enable_prealloc")
    if any(r not in fields for r in required):
        return None
    if "total_mem_size_mb" not in fields:
        fields["total_mem_size_mb"] = (int(fields["num_kv_buffers"]) * int(fields["num_layers"])
                                       * int(fields["mem_size_per_layer_mb"]))
    return BannerInfo(raw=line[idx:].strip()[:2000], line_no=line_no, source=source, **fields)


# A wrapped banner's continuation line: nothing but `key=value` fields (the seed quotes it so).
_CONTINUATION = re.compile(r"^\s*(?:\w+=-?\d+(?:MB)?\s*,?\s*)+$")
_MAX_CONTINUATION_LINES = 4


def parse_banners(lines: Iterable[str], source: str | None = None) -> list[BannerInfo]:
    """Every banner in ``lines`` (1-based line numbers).

    kvcached prints the banner on one line; a banner pasted from an issue or a wrapping log
    viewer may continue on the next lines, which are joined when they hold only fields.
    """
    text = list(lines)
    out: list[BannerInfo] = []
    for i, line in enumerate(text):
        if BANNER_MARKER not in line:
            continue
        joined = line
        for nxt in text[i + 1:i + 1 + _MAX_CONTINUATION_LINES]:
            if "max_reserved_pages=" in joined or BANNER_MARKER in nxt or not _CONTINUATION.match(nxt):
                break
            joined = f"{joined.rstrip()} {nxt.strip()}"
        banner = parse_banner(joined, i + 1, source) or parse_banner(line, i + 1, source)
        if banner is not None:
            out.append(banner)
    return out


def pages_per_layer(banner: BannerInfo) -> int:
    if banner.page_size_mb <= 0:
        return 0
    return banner.mem_size_per_layer_mb // banner.page_size_mb


def assess_risk(banner: BannerInfo, gpu_utilization: float | None = None,
                device_free_fraction: float | None = None) -> BannerRisk:
    """Static check: does this banner predict the prealloc deadlock?

    With prealloc on, the worker's first reserve takes min(min_reserved, pool)
    pages off the free list. When the whole pool is that small, the free list is
    empty while the worker maps, and the first alloc_page waits on it. The
    utilization headroom check flags the unsigned-underflow path: a device fuller
    than (1 - utilization) removes the physical-memory cap on the reserve.
    """
    pages = pages_per_layer(banner)
    reasons: list[str] = []
    if banner.enable_prealloc:
        if pages <= banner.min_reserved_pages:
            reasons.append(
                f"pool is {pages} page(s) per layer ({banner.mem_size_per_layer_mb} MB / "
                f"{banner.page_size_mb} MB) <= min_reserved_pages={banner.min_reserved_pages}: the prealloc "
                "worker's first reserve empties the free list, so the first alloc_page waits on it")
        if (gpu_utilization is not None and device_free_fraction is not None
                and device_free_fraction < (1.0 - gpu_utilization)):
            reasons.append(
                f"device free {device_free_fraction:.1%} is below the utilization headroom "
                f"{1.0 - gpu_utilization:.1%}: the unsigned headroom subtraction wraps and the reserve is uncapped")
        if pages == 0:
            reasons.append("mem_size_per_layer is smaller than one page: the pool has no pages at all")
    return BannerRisk(risky=bool(reasons), pages_per_layer=pages, reasons=reasons)


def load_risk(banner: BannerInfo) -> str | None:
    """The deadlock a banner leaves open once the engine serves: with prealloc on, a kvcached without
    the #422 fix hangs in the same GIL cycle whenever load empties the free list (a KV pool filled up:
    the runtime stall), whatever the pool's size. None: prealloc off (no prealloc worker)."""
    if not banner.enable_prealloc:
        return None
    return (f"prealloc is on: when load fills the KV pool ({pages_per_layer(banner)} page(s) per layer), "
            "alloc_page waits with the GIL held while the prealloc worker needs it (kvcached #371 at runtime); "
            "only a kvcached with the #422 fix is safe")


def assess_risk_for(banner: BannerInfo, allocator: str | None) -> BannerRisk:
    """The one judgement of a banner (``kvdiag banner``, ``doctor`` and every report read it): the
    start-up risk of :func:`assess_risk` and the risk under load of :func:`load_risk`, for an engine
    running ``allocator`` (None: unknown, judged as kvcached's own). The deadlock a banner predicts is
    the stock allocator's (alloc_page waits holding the GIL); the fixed one waits without it, so for a
    fixed-allocator engine neither risk applies and the start-up reasons become notes."""
    risk = assess_risk(banner)
    if allocator == "fixed":
        return BannerRisk(risky=False, pages_per_layer=risk.pages_per_layer,
                          reasons=[f"no deadlock with the fixed allocator (it waits without holding the GIL); "
                                   f"the stock allocator would hang: {reason}" for reason in risk.reasons])
    return risk.model_copy(update={"load_risk": load_risk(banner)})
