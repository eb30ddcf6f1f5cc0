"""The one catalog of known kvcached defects: what each is, where upstream tracks it, what fixed it and how
to live without the fix. The build fingerprint (environment), the verdict's recognition (analyze.known),
doctor's rules and the banner command all name a defect from here.
"""

from __future__ import annotations

from dataclasses import dataclass

_TRACKER_URL = "https://github.com/ovg-project/kvcached/issues/"


@dataclass(frozen=True)
class KvcachedDefect:
    key: str                        # the build check's name: "gil_holding_alloc_page"
    title: str                      # what is wrong, in one line
    issue: int                      # kvcached's issue number
    fixed_by: str                   # the change that fixed it: "PR #422 (666671b)"
    fixed_in: str | None            # first release with the fix (None: not known to be released)
    workaround: str | None = None   # how to run a build without the fix
    also: tuple[int, ...] = ()      # other issues reporting the same defect

    @property
    def id(self) -> str:
        """``kvcached#371``: how a verdict names it."""
        return f"kvcached#{self.issue}"

    @property
    def ticket(self) -> str:
        """``kvcached #371``: how doctor's rows name it."""
        return f"kvcached #{self.issue}"

    @property
    def url(self) -> str:
        return f"{_TRACKER_URL}{self.issue}"

    @property
    def upstream(self) -> str:
        """``kvcached #371 (also #334), fixed by PR #422 (666671b), first in 0.1.6``."""
        also = f" (also {', '.join(f'#{n}' for n in self.also)})" if self.also else ""
        release = f", first in {self.fixed_in}" if self.fixed_in else ""
        return f"{self.ticket}{also}, fixed by {self.fixed_by}{release}"


GIL_HOLDING_ALLOC_PAGE = KvcachedDefect(
    key="gil_holding_alloc_page",
    title="alloc_page keeps the GIL while it waits; the prealloc thread calls back into Python",
    issue=371, also=(334,), fixed_by="PR #422 (666671b)", fixed_in="0.1.6",
    workaround="KVCACHED_PAGE_PREALLOC_ENABLED=false")
UNBOUNDED_IPC_READ = KvcachedDefect(
    key="unbounded_ipc_read", title="worker IPC reply read with no timeout",
    issue=371, fixed_by="PR #422 (KVCACHED_IPC_TIMEOUT)", fixed_in="0.1.6",
    workaround="restart the stuck worker; a kvcached >= 0.1.6 fails after KVCACHED_IPC_TIMEOUT seconds")
HEADROOM_UNDERFLOW = KvcachedDefect(
    key="headroom_underflow",
    title="unsigned underflow in get_avail_physical_pages removes the reserve's memory cap",
    issue=377, fixed_by="f8b07c8 (saturating_subtract)", fixed_in="0.1.6")
BLOCK_OVER_PAGE = KvcachedDefect(
    key="block_over_page", title="a KV block larger than one page: the pool is empty and warm-up hangs silently",
    issue=367, fixed_by="fea40de (refuses to start, naming KVCACHED_PAGE_SIZE_MB)", fixed_in=None,
    workaround="raise KVCACHED_PAGE_SIZE_MB")

CATALOG: tuple[KvcachedDefect, ...] = (GIL_HOLDING_ALLOC_PAGE, UNBOUNDED_IPC_READ, HEADROOM_UNDERFLOW,
                                       BLOCK_OVER_PAGE)
BY_KEY = {d.key: d for d in CATALOG}

# What to install so both halves of the co-location hang (GIL and IPC) are fixed.
FIX_BUILD = (f"install kvcached >= {GIL_HOLDING_ALLOC_PAGE.fixed_in} (or a git build at or after 666671b, "
             "PR #422)")
FIX_PREALLOC = f"{GIL_HOLDING_ALLOC_PAGE.workaround} on this engine"
