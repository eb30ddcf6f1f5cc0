"""`kvdiag doctor`'s rules: known kvcached risks judged from the environment and a scenario. Pure.

Each rule returns :class:`DoctorCheck` rows, one per subject, each with a
status (risk / ok / unknown / n/a), what it found and what to change:

- ``prealloc_pool``: prealloc on and a pool of at most min_reserved pages per
  layer: the worker's first reserve empties the free list (the seed's engine 2);
- ``colocation``: two or more kvcached engines on one GPU, a later one with
  prealloc on (kvcached #371's co-location hang);
- ``allocator_build``: an installed kvcached (or a scenario's simulated engine)
  with the pre-#422 allocator;
- ``headroom``: a GPU fuller than kvcached's utilization headroom (#377
  underflow on older builds), or engines that together claim more;
- ``page_vs_block``: a KV block that does not fit in one page (#367);
- ``capture_access``: a warning when kvdiag's tracers would be refused here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdiag.kvcached.banner import assess_risk_for, pages_per_layer
from kvdiag.kvcached.defects import (
    BLOCK_OVER_PAGE,
    FIX_BUILD,
    FIX_PREALLOC,
    GIL_HOLDING_ALLOC_PAGE,
    HEADROOM_UNDERFLOW,
)
from kvdiag.model.doctor import DoctorCheck, RiskStatus
from kvdiag.model.environment import DefectStatus, EnvironmentRecord, KvcachedBuild
from kvdiag.model.run import BannerInfo

DEFAULT_KVCACHED_UTIL = 0.95
_GIL = GIL_HOLDING_ALLOC_PAGE.ticket
_UNDERFLOW = HEADROOM_UNDERFLOW.ticket
_BLOCK = BLOCK_OVER_PAGE.ticket


@dataclass
class EnginePlan:
    """What a scenario says about one engine, resolved by the caller (environment merged)."""

    name: str
    kind: str                        # "sim" | "vllm" (kvdiag's plugin allocator) | "command"
    kvcached: bool                   # kvcached manages this engine's KV cache
    prealloc: bool
    device: str                      # engines with equal devices share a GPU
    allocator: str = "external"      # sim: stock | fixed; command: external (the installed kvcached)
    banner: BannerInfo | None = None  # what its PageAllocator banner will say, when known
    gpu_memory_utilization: float | None = None
    kvcached_util: float = DEFAULT_KVCACHED_UTIL
    page_size_mb: int | None = None
    tokens_per_page: int | None = None   # sim: tokens one page holds
    block_size: int | None = None
    env_errors: list[str] = field(default_factory=list)

    @property
    def kvdiag_allocator(self) -> bool:
        """Its pool is kvdiag's own allocator (stock or fixed): a simulated engine, or a real vLLM
        engine with kvdiag's plugin."""
        return self.kind in ("sim", "vllm")

    @property
    def what(self) -> str:
        return "simulated engine" if self.kind == "sim" else "vLLM engine"


def _row(check: str, subject: str, status: RiskStatus, detail: str, fix: str | None = None,
         upstream: str | None = None) -> DoctorCheck:
    return DoctorCheck(check=check, subject=subject, status=status, detail=detail, fix=fix, upstream=upstream)


def pool_checks(engines: Sequence[EnginePlan], banners: Sequence[BannerInfo],
                env: EnvironmentRecord) -> list[DoctorCheck]:
    """The pool each banner (or planned engine) gets, judged as `kvdiag banner` judges it: at start-up, and
    under load unless the engine's allocator (or, for a log's banner, this host's kvcached) has the fix."""
    rows: list[DoctorCheck] = []
    subjects: list[tuple[str, BannerInfo | None, EnginePlan | None]] = [
        (f"engine {e.name}", e.banner, e) for e in engines if e.kvcached]
    subjects += [(f"banner {b.source or ''}:{b.line_no or '?'}", b, None) for b in banners]
    for subject, banner, plan in subjects:
        if banner is None:
            rows.append(_row("prealloc_pool", subject, RiskStatus.UNKNOWN,
                             "pool size unknown until the engine prints its PageAllocator banner",
                             "run `kvdiag banner LOG` on its log, or pass `--log LOG` here"))
            continue
        risk = assess_risk_for(banner, None)
        pages = pages_per_layer(banner)
        pool = (f"{pages} page(s) per layer ({banner.mem_size_per_layer_mb} MB / {banner.page_size_mb} MB), "
                f"min_reserved_pages={banner.min_reserved_pages}, prealloc={'on' if banner.enable_prealloc else 'off'}")
        pool_reasons = [r for r in risk.reasons if "min_reserved" in r or "smaller than one page" in r]
        if pool_reasons:
            sim_fixed = plan is not None and plan.kvdiag_allocator and plan.allocator == "fixed"
            rows.append(_row("prealloc_pool", subject, RiskStatus.OK if sim_fixed else RiskStatus.RISK,
                             pool_reasons[0] + (" (the fixed allocator does not wait with the GIL "
                                                            "held)" if sim_fixed else ""),
                             None if sim_fixed else
                             f"{FIX_PREALLOC}, or a bigger KV pool (more than {banner.min_reserved_pages} pages "
                             f"per layer: raise --gpu-memory-utilization or lower KVCACHED_MIN_RESERVED_PAGES), "
                             f"or {FIX_BUILD}", _GIL))
        elif risk.load_risk is not None and plan is None and env.kvcached.verdict not in _SAFE_BUILDS:
            # A planned engine's build is judged once, in its allocator_build row; a log's banner has no
            # other row, and `kvdiag banner` calls the same banner a risk.
            rows.append(_row("prealloc_pool", subject, RiskStatus.RISK, risk.load_risk,
                             f"{FIX_PREALLOC}, or {FIX_BUILD}", _GIL))
        else:
            rows.append(_row("prealloc_pool", subject, RiskStatus.OK, pool))
    return rows


def colocation_checks(engines: Sequence[EnginePlan], env: EnvironmentRecord) -> list[DoctorCheck]:
    rows: list[DoctorCheck] = []
    groups: dict[str, list[EnginePlan]] = {}
    for e in engines:
        if e.kvcached:
            groups.setdefault(e.device, []).append(e)
    for device, members in groups.items():
        names = ", ".join(e.name for e in members)
        if len(members) < 2:
            rows.append(_row("colocation", f"{device}", RiskStatus.OK, f"one kvcached engine ({names})"))
            continue
        later = [e for e in members[1:] if e.prealloc]
        fixed = all(_build_fixed(e, env) for e in members)
        if later and not fixed:
            rows.append(_row(
                "colocation", device, RiskStatus.RISK,
                f"kvcached engines {names} share one GPU and {', '.join(e.name for e in later)} start(s) with "
                f"prealloc on while an earlier engine is live (the co-location hang of kvcached #371)",
                f"one kvcached engine per GPU, or {FIX_PREALLOC.replace('this engine', 'the later engines')}, "
                f"or {FIX_BUILD} (and >= #448 so co-located engines get a real virtual pool)", _GIL))
        elif later:
            rows.append(_row("colocation", device, RiskStatus.OK,
                             f"kvcached engines {names} share one GPU; the allocator has the #422 fix"))
        else:
            rows.append(_row("colocation", device, RiskStatus.OK,
                             f"kvcached engines {names} share one GPU, prealloc off on the later ones"))
    rt = env.kvcached_runtime
    if rt is not None and rt.segments:
        live = ", ".join(s.name for s in rt.segments)
        pre = any(k.verdict == "pre_fix" for _, k, _ in kvcached_builds(env))
        rows.append(_row("colocation", "this host (live)", RiskStatus.RISK if pre else RiskStatus.OK,
                         f"{len(rt.segments)} kvcached engine(s) live now ({live}); a new prealloc engine on the "
                         f"same GPU is co-located" + (" with a pre-fix build" if pre else ""),
                         f"start the new engine with {GIL_HOLDING_ALLOC_PAGE.workaround}, or {FIX_BUILD}"
                         if pre else None, _GIL if pre else None))
    return rows


def kvcached_builds(env: EnvironmentRecord) -> list[tuple[str, KvcachedBuild, list[str]]]:
    """(whose, build, engine names) of every kvcached build judged: each engine interpreter's, then
    kvdiag's own (``installed kvcached``), which judges the engines that have no interpreter of their own."""
    out = [(f"kvcached of {ip.who} ({ip.python})", ip.kvcached, ip.engines)
           for ip in env.engine_packages if ip.kvcached is not None]
    return [*out, ("installed kvcached", env.kvcached, [])]


_SAFE_BUILDS = ("fixed", "not_affected")


def _engine_build(e: EnginePlan, env: EnvironmentRecord) -> KvcachedBuild:
    """The kvcached build engine ``e`` imports: its interpreter's when recorded, else kvdiag's own."""
    return next((b for _, b, names in kvcached_builds(env) if e.name in names), env.kvcached)


def _build_fixed(e: EnginePlan, env: EnvironmentRecord) -> bool:
    if e.kvdiag_allocator:
        return e.allocator == "fixed"
    return _engine_build(e, env).verdict in _SAFE_BUILDS


def _build_row(subject: str, k: KvcachedBuild, env: EnvironmentRecord) -> DoctorCheck:
    gil = next((c for c in k.checks if c.defect == "gil_holding_alloc_page"), None)
    others = [c for c in k.checks if c.defect != "gil_holding_alloc_page" and c.status is DefectStatus.PRESENT]
    extra = "".join(f"; also {c.title} ({c.upstream})" for c in others)
    where = f"kvcached {k.version or '?'}" + (f" (git {k.git_commit[:12]})" if k.git_commit else "") + \
        (f" at {k.location}" if k.location else "")
    if not k.installed:
        return _row("allocator_build", subject, RiskStatus.NOT_APPLICABLE,
                    "kvcached is not installed here" if subject == "installed kvcached" else
                    "this interpreter has no kvcached")
    if k.verdict == "pre_fix":
        ev = "; ".join(gil.evidence[:2]) if gil else ""
        off = env.env.get("KVCACHED_PAGE_PREALLOC_ENABLED", "true").strip().lower() != "true"
        return _row("allocator_build", subject, RiskStatus.OK if off and not others else RiskStatus.RISK,
                    f"{where}: pre-fix build: {ev}{extra}"
                    + (" (KVCACHED_PAGE_PREALLOC_ENABLED is off here: no prealloc worker, no GIL cycle)"
                       if off else ""),
                    f"{FIX_BUILD}; until then {GIL_HOLDING_ALLOC_PAGE.workaround}",
                    gil.upstream if gil else None)
    if k.verdict in ("fixed", "not_affected"):
        return _row("allocator_build", subject, RiskStatus.RISK if others else RiskStatus.OK,
                    f"{where}: {k.summary}{extra}", FIX_BUILD if others else None)
    return _row("allocator_build", subject, RiskStatus.UNKNOWN, f"{where}: {k.summary}")


def build_checks(engines: Sequence[EnginePlan], env: EnvironmentRecord) -> list[DoctorCheck]:
    """One row per kvcached build (each engine interpreter's and kvdiag's own), then the engines that run
    kvdiag's own allocator (simulated, or vLLM with kvdiag's plugin)."""
    rows = [_build_row(subject, k, env) for subject, k, _ in kvcached_builds(env)]
    for e in engines:
        if e.kvdiag_allocator and e.kvcached:
            if e.allocator == "stock" and not e.prealloc:
                rows.append(_row("allocator_build", f"engine {e.name}", RiskStatus.OK,
                                 f"{e.what} with kvdiag's stock allocator (the pre-#422 model), prealloc "
                                 "off: no prealloc worker, so no GIL cycle"))
            elif e.allocator == "stock":
                rows.append(_row("allocator_build", f"engine {e.name}", RiskStatus.RISK,
                                 f"{e.what} with kvdiag's stock allocator: the pre-#422 model (alloc_page "
                                 "waits with the GIL held)",
                                 "allocator: fixed in the scenario (or `--allocator fixed`) to see the fix",
                                 _GIL))
            else:
                rows.append(_row("allocator_build", f"engine {e.name}", RiskStatus.OK,
                                 f"{e.what} with kvdiag's {e.allocator} allocator"))
    return rows


def headroom_checks(engines: Sequence[EnginePlan], env: EnvironmentRecord) -> list[DoctorCheck]:
    rows: list[DoctorCheck] = []
    # The first installed build's (an engine interpreter's before kvdiag's own).
    underflow = next((c for _, k, _ in kvcached_builds(env) if k.installed for c in k.checks
                      if c.defect == "headroom_underflow"), None)
    wraps = underflow is None or underflow.status is not DefectStatus.FIXED
    util = DEFAULT_KVCACHED_UTIL
    raw = env.env.get("KVCACHED_GPU_UTILIZATION")
    try:
        util = float(raw) if raw else util
    except ValueError:
        pass
    if not env.gpus:
        rows.append(_row("headroom", "GPUs", RiskStatus.NOT_APPLICABLE, env.gpu_note or "no GPU"))
    for g in env.gpus:
        if g.total_mb is None or g.free_mb is None:
            rows.append(_row("headroom", f"GPU {g.index}", RiskStatus.UNKNOWN, "free memory unknown"))
            continue
        headroom = g.total_mb * (1.0 - util)
        detail = (f"{g.free_mb / 1024:.1f} GiB free of {g.total_mb / 1024:.1f} GiB; kvcached keeps "
                  f"{headroom / 1024:.1f} GiB ({1 - util:.0%}, KVCACHED_GPU_UTILIZATION={util:g})")
        if g.free_mb < headroom:
            rows.append(_row("headroom", f"GPU {g.index}", RiskStatus.RISK,
                             detail + (": below it, and on a build without #377's fix the unsigned subtraction "
                                       "wraps so the prealloc reserve is uncapped" if wraps else ": below it"),
                             "free GPU memory (lower the engines' --gpu-memory-utilization)"
                             + (f", and {FIX_BUILD}" if wraps else ""), _UNDERFLOW))
        else:
            rows.append(_row("headroom", f"GPU {g.index}", RiskStatus.OK, detail))
    groups: dict[str, list[EnginePlan]] = {}
    for e in engines:
        if e.kvcached and e.gpu_memory_utilization is not None:
            groups.setdefault(e.device, []).append(e)
    for device, members in groups.items():
        total = sum(e.gpu_memory_utilization or 0.0 for e in members)
        limit = min(e.kvcached_util for e in members)
        parts = " + ".join(f"{e.name} {e.gpu_memory_utilization:g}" for e in members)
        if total > limit:
            rows.append(_row("headroom", device, RiskStatus.RISK,
                             f"engines claim {parts} = {total:.2f} of the device, more than "
                             f"KVCACHED_GPU_UTILIZATION={limit:g}: the device ends fuller than kvcached's headroom",
                             f"lower --gpu-memory-utilization so the sum stays <= {limit:g}", _UNDERFLOW))
        else:
            rows.append(_row("headroom", device, RiskStatus.OK,
                             f"engines claim {parts} = {total:.2f} of the device (<= {limit:g})"))
    return rows


def page_block_checks(engines: Sequence[EnginePlan]) -> list[DoctorCheck]:
    rows: list[DoctorCheck] = []
    for e in engines:
        if not e.kvcached:
            continue
        subject = f"engine {e.name}"
        if e.kind == "vllm":
            rows.append(_row("page_vs_block", subject, RiskStatus.NOT_APPLICABLE,
                             f"kvdiag's plugin backs vLLM's blocks with whole {e.page_size_mb or '?'} MB pages of "
                             "its own pool (the model's block size never meets kvcached's page size)"))
            continue
        if e.kind == "sim":
            rows.append(_row("page_vs_block", subject, RiskStatus.NOT_APPLICABLE,
                             f"simulated engine: it allocates whole {e.page_size_mb or '?'} MB pages of "
                             f"{e.tokens_per_page or '?'} tokens (its block size only shows in its logs)"))
            continue
        if e.page_size_mb is not None and e.page_size_mb % 2:
            rows.append(_row("page_vs_block", subject, RiskStatus.RISK,
                             f"KVCACHED_PAGE_SIZE_MB={e.page_size_mb} is not a multiple of 2 MB",
                             "KVCACHED_PAGE_SIZE_MB=2 (or 4, 8, ...)"))
            continue
        if e.tokens_per_page is not None and e.block_size is not None:
            if e.tokens_per_page < e.block_size:
                rows.append(_row("page_vs_block", subject, RiskStatus.RISK,
                                 f"a page holds {e.tokens_per_page} tokens, a KV block needs {e.block_size}",
                                 "raise KVCACHED_PAGE_SIZE_MB", _BLOCK))
            else:
                rows.append(_row("page_vs_block", subject, RiskStatus.OK,
                                 f"a {e.page_size_mb or '?'} MB page holds {e.tokens_per_page} tokens, "
                                 f"{e.tokens_per_page // e.block_size} block(s) of {e.block_size}"))
            continue
        rows.append(_row("page_vs_block", subject, RiskStatus.UNKNOWN,
                         f"page {e.page_size_mb or 2} MB; a block's size depends on the model (hybrid linear-"
                         "attention/Mamba state can exceed a page): a kvcached with #367 refuses to start naming "
                         "KVCACHED_PAGE_SIZE_MB, older builds hang silently in warm-up",
                         "if warm-up hangs with an empty pool, raise KVCACHED_PAGE_SIZE_MB", _BLOCK))
    return rows


def access_checks(env: EnvironmentRecord) -> list[DoctorCheck]:
    """Whether kvdiag could capture a hung engine here (a warning, not a hang risk)."""
    p = env.ptrace
    if p.problem:
        return [_row("capture_access", "this host", RiskStatus.WARN, p.problem, p.fix)]
    scope = "absent" if p.yama_ptrace_scope is None else str(p.yama_ptrace_scope)
    return [_row("capture_access", "this host", RiskStatus.OK,
                 f"py-spy/pystack/gdb may attach (yama ptrace_scope {scope}, CAP_SYS_PTRACE "
                 f"{'yes' if p.cap_sys_ptrace else 'no'})")]


def doctor_checks(env: EnvironmentRecord, engines: Sequence[EnginePlan] = (),
                  banners: Sequence[BannerInfo] = ()) -> list[DoctorCheck]:
    """Every rule, in the order a reader goes through them."""
    return (build_checks(engines, env) + pool_checks(engines, banners, env) + colocation_checks(engines, env)
            + headroom_checks(engines, env) + page_block_checks(engines) + access_checks(env))
