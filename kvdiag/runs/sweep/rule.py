"""The boundary of a sweep as a rule in words, and the check against the banner's static risk rule. Pure.

Each cell has features: the varied fields' values and, for every engine whose KV pool is kvdiag's
allocator, the settings it launches with (prealloc, allocator, pages per layer, min/max reserved
pages, read from the same environment the launcher builds). The rule is the smallest conjunction
of atoms (``prealloc on``, ``pages per layer ≤ min_reserved_pages``, ``min_reserved_pages ≥ 4``)
that is true on exactly the cells that hung; when none of up to three atoms fits, an "or" of two
short conjunctions is tried, and failing that the closest conjunction is given with the cells it
gets wrong. Comparisons between two page counts of one engine are preferred to thresholds on a
single field: they say why, and they hold beyond the grid's range.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvdiag.launch.engines import launched_pool
from kvdiag.model.scalar import show_scalar
from kvdiag.model.sweep import BannerCheck, BannerDisagreement, Scalar, SweepCell, SweepRule
from kvdiag.scenario.models import EngineSpec, Scenario

BANNER_RULE = ("risk ⇔ prealloc on and pages per layer (mem_size_per_layer / page_size) ≤ min_reserved_pages, "
               "with the stock allocator (kvdiag/kvcached/banner.py)")
_PAGE_FEATURES = ("pages_per_layer", "min_reserved_pages", "max_reserved_pages")
_WORDS = {"pages_per_layer": "pages per layer", "prealloc": "prealloc", "allocator": "allocator"}
MAX_CONJUNCTION = 3


def engine_features(spec: EngineSpec, environ: Mapping[str, str] | None = None) -> dict[str, Scalar]:
    """The pool settings one engine launches with (kvdiag's allocator engines only; else empty)."""
    s = launched_pool(spec, environ)
    if s is None:
        return {}
    pool = spec.sim if spec.kind == "sim" else spec.vllm.pool
    return {
        "prealloc": s.prealloc_on,
        "allocator": spec.allocator if spec.allocator != "external" else "stock",
        "pages_per_layer": s.pages_per_layer(pool.kv_per_layer_mb, pool.page_size_mb),
        "min_reserved_pages": s.min_reserved_pages if s.min_reserved_pages is not None else pool.min_reserved_pages,
        "max_reserved_pages": s.max_reserved_pages if s.max_reserved_pages is not None else pool.max_reserved_pages,
    }


def cell_features(scenario: Scenario, params: Mapping[str, Scalar],
                  environ: Mapping[str, str] | None = None) -> dict[str, Scalar]:
    """Features of one cell: ``engine.feature`` for each kvdiag-allocator engine, then the axes' values."""
    out: dict[str, Scalar] = {}
    for spec in scenario.engines:
        for name, value in engine_features(spec, environ).items():
            out[f"{spec.name}.{name}"] = value
    for label, value in params.items():
        out.setdefault(label, value)
    return out


@dataclass(frozen=True)
class Atom:
    text: str         # with the engine named: "vlm: pages per layer ≤ min_reserved_pages"
    engine: str | None
    words: str        # without it: "pages per layer ≤ min_reserved_pages"
    cost: float
    mask: int         # bit i set: true on decided cell i
    rank: int = 0     # order in the words: settings first, then comparisons


def _split(feature: str) -> tuple[str | None, str]:
    engine, dot, name = feature.partition(".")
    if dot and name in (*_PAGE_FEATURES, "prealloc", "allocator"):
        return engine, name
    return None, feature


def _word(name: str) -> str:
    return _WORDS.get(name, name)


def _atoms(features: list[dict[str, Scalar]]) -> list[Atom]:
    n = len(features)
    full = (1 << n) - 1
    names = sorted({k for f in features for k in f})
    atoms: list[Atom] = []

    def add(feature_engine: str | None, words: str, cost: float, pred: list[bool], rank: int = 1) -> None:
        mask = sum(1 << i for i, ok in enumerate(pred) if ok)
        if mask in (0, full):
            return
        text = f"{feature_engine}: {words}" if feature_engine else words
        atoms.append(Atom(text, feature_engine, words, cost, mask, rank))

    for name in names:
        values = [f.get(name) for f in features]
        if any(v is None for v in values):
            continue
        engine, base = _split(name)
        derived = engine is not None
        distinct = sorted({v for v in values if v is not None}, key=lambda v: (str(type(v)), v))
        if all(isinstance(v, bool) for v in distinct) or all(isinstance(v, str) for v in distinct):
            for d in distinct:
                words = (f"{_word(base)} {show_scalar(d)}" if isinstance(d, bool) or base == "allocator"
                         else f"{_word(base)} = {show_scalar(d)}")
                # a setting varied on every engine at once reads best without an engine's name
                add(engine, words, 1.05 if derived else 1.0, [v == d for v in values], rank=0)
            continue
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in distinct):
            continue
        for t in distinct:
            add(engine, f"{_word(base)} ≤ {show_scalar(t)}", 2.0 if derived else 2.5,
                [v <= t for v in values])  # type: ignore[operator]
            add(engine, f"{_word(base)} ≥ {show_scalar(t)}", 2.0 if derived else 2.5,
                [v >= t for v in values])  # type: ignore[operator]
    engines = sorted({_split(k)[0] for k in names if _split(k)[0] is not None}, key=str)
    for engine in engines:
        for a, b in itertools.permutations(_PAGE_FEATURES, 2):
            ka, kb = f"{engine}.{a}", f"{engine}.{b}"
            if any(ka not in f or kb not in f for f in features):
                continue
            va = [f[ka] for f in features]
            vb = [f[kb] for f in features]
            # pages-per-layer first in the words when it takes part: the pool against its reserve
            cost = 1.0 if a == "pages_per_layer" else 1.2
            add(engine, f"{_word(a)} ≤ {_word(b)}", cost, [x <= y for x, y in zip(va, vb, strict=True)])  # type: ignore[operator]
            add(engine, f"{_word(a)} < {_word(b)}", cost + 0.1, [x < y for x, y in zip(va, vb, strict=True)])  # type: ignore[operator]
    best: dict[int, Atom] = {}
    for atom in atoms:
        if atom.mask not in best or atom.cost < best[atom.mask].cost:
            best[atom.mask] = atom
    return sorted(best.values(), key=lambda a: (a.cost, a.text))


def _conjunctions(atoms: list[Atom], full: int, size: int) -> list[tuple[Atom, ...]]:
    return [c for c in itertools.combinations(atoms, size)]


def _mask(conj: Sequence[Atom], full: int) -> int:
    m = full
    for a in conj:
        m &= a.mask
    return m


def _words(terms: Sequence[Sequence[Atom]]) -> tuple[str, str | None]:
    """The rule's words; the engine is named once when every atom is about the same one."""
    engines = {a.engine for t in terms for a in t if a.engine is not None}
    one = next(iter(engines)) if len(engines) == 1 else None
    parts = [" and ".join(a.words if one is not None or a.engine is None else a.text
                          for a in sorted(t, key=lambda a: a.rank)) for t in terms]
    text = parts[0] if len(parts) == 1 else " or ".join(f"({p})" for p in parts)
    return text, one


def infer_rule(cells: Sequence[SweepCell]) -> SweepRule:
    """The rule ``hangs ⇔ ...`` over the cells that always or never hung (mixed cells are listed apart)."""
    decided = [c for c in cells if c.outcome in ("hang", "healthy")]
    mixed = [c.key for c in cells if c.outcome == "mixed"]
    if not decided:
        return SweepRule(text="no cell finished with a hang or a healthy start: no rule", fits=False, mixed=mixed)
    feats = [c.features for c in decided]
    n = len(decided)
    full = (1 << n) - 1
    target = sum(1 << i for i, c in enumerate(decided) if c.outcome == "hang")
    context = _context(feats)
    if target == 0:
        return SweepRule(text="no cell hangs", fits=True, mixed=mixed, context=context, decided=n)
    if target == full:
        return SweepRule(text="every cell hangs", fits=True, mixed=mixed, context=context, decided=n)
    atoms = _atoms(feats)
    for size in range(1, MAX_CONJUNCTION + 1):
        fits = [c for c in _conjunctions(atoms, full, size) if _mask(c, full) == target]
        if fits:
            fits.sort(key=lambda c: (sum(a.cost for a in c), [a.text for a in c]))
            return _rule([fits[0]], decided, target, full, mixed, feats,
                         [_words([c])[0] for c in fits[1:4]])
    # An "or" of two conjunctions of at most two atoms, each true on hung cells only.
    pure = [c for size in (1, 2) for c in _conjunctions(atoms, full, size)
            if _mask(c, full) and _mask(c, full) & ~target == 0]
    pure.sort(key=lambda c: (sum(a.cost for a in c), [a.text for a in c]))
    for x, y in itertools.combinations(pure[:400], 2):
        if _mask(x, full) | _mask(y, full) == target:
            return _rule([x, y], decided, target, full, mixed, feats, [])
    # Nothing fits: the closest short conjunction, with the cells it gets wrong.
    candidates = [c for size in (1, 2) for c in _conjunctions(atoms, full, size)]
    if not candidates:
        return SweepRule(text="the varied settings do not separate the hung cells from the healthy ones",
                         fits=False, mixed=mixed, context=context, decided=n,
                         wrong=[c.key for c in decided])
    best = min(candidates, key=lambda c: (bin(_mask(c, full) ^ target).count("1"), sum(a.cost for a in c)))
    return _rule([best], decided, target, full, mixed, feats, [])


def _rule(terms: list[tuple[Atom, ...]], decided: Sequence[SweepCell], target: int, full: int,
          mixed: list[str], feats: list[dict[str, Scalar]], alternatives: list[str]) -> SweepRule:
    got = 0
    for t in terms:
        got |= _mask(t, full)
    wrong = [c.key for i, c in enumerate(decided) if ((got ^ target) >> i) & 1]
    words, engine = _words(terms)
    engines = {a.engine for t in terms for a in t if a.engine is not None}
    text = f"hangs ⇔ {words}" + (f" (engine {engine})" if engine else "")
    return SweepRule(text=text, fits=not wrong, wrong=wrong, mixed=mixed,
                     context=_context(feats, engines or None), alternatives=alternatives, decided=len(decided))


def _context(feats: list[dict[str, Scalar]], engines: set[str] | None = None) -> list[str]:
    """Settings equal in every cell (prealloc, allocator) of the engines the rule is about."""
    out: list[str] = []
    if not feats:
        return out
    for key in sorted(feats[0]):
        engine, base = _split(key)
        if engine is None or base not in ("prealloc", "allocator"):
            continue
        if engines is not None and engine not in engines:
            continue
        values = {f.get(key) for f in feats}
        if len(values) == 1:
            value = next(iter(values))
            if value is not None:
                out.append(f"{engine}: {_word(base)} {show_scalar(value)}")
    return out


def rule_predicts(rule_cells: Sequence[SweepCell], rule: SweepRule) -> dict[str, bool]:
    """Which decided cells the rule calls hung (its fit: the hung cells except those it gets wrong)."""
    out: dict[str, bool] = {}
    wrong = set(rule.wrong)
    for c in rule_cells:
        if c.outcome in ("hang", "healthy"):
            hung = c.outcome == "hang"
            out[c.key] = (not hung) if c.key in wrong else hung
    return out


def banner_check(cells: Sequence[SweepCell]) -> BannerCheck:
    """Each decided cell's outcome against what the engines' printed banners predict
    (:func:`kvdiag.kvcached.banner.assess_risk_for`, as stored in each run's report)."""
    disagreements: list[BannerDisagreement] = []
    checked = 0
    for c in cells:
        if c.outcome not in ("hang", "healthy"):
            continue
        checked += 1
        predicted = c.banner_predicts_hang
        reasons = next((r.banner_reasons for r in c.runs if r.banner_reasons), [])
        if predicted is None:
            if c.outcome == "hang":
                disagreements.append(BannerDisagreement(key=c.key, params=c.params, observed=c.outcome,
                                                        banner="no banner", reasons=reasons))
            continue
        if predicted != (c.outcome == "hang"):
            disagreements.append(BannerDisagreement(key=c.key, params=c.params, observed=c.outcome,
                                                    banner="risk" if predicted else "no risk", reasons=reasons))
    if not checked:
        text = "no cell finished hung or healthy: nothing to check against the banner rule"
    elif not disagreements:
        text = f"the banner's static risk rule agrees with every cell ({checked} of {checked})"
    else:
        shown = "; ".join(
            f"{', '.join(f'{k}={show_scalar(v)}' for k, v in d.params.items())}: {d.observed}, banner says {d.banner}"
            for d in disagreements[:5])
        more = f" (+{len(disagreements) - 5} more)" if len(disagreements) > 5 else ""
        text = (f"the banner's static risk rule disagrees with {len(disagreements)} of {checked} cells "
                f"(a bug in the rule or a new finding): {shown}{more}")
    return BannerCheck(rule=BANNER_RULE, agree=not disagreements and checked > 0, checked=checked,
                       disagreements=disagreements, text=text)
