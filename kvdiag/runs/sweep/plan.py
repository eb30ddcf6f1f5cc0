"""Which cells a sweep runs: the full grid, or a bisection along one numeric axis for every setting of
the others (its two ends first, then halving the interval where the outcome changes). Pure."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field

from kvdiag.model.scalar import show_scalar
from kvdiag.model.sweep import Scalar
from kvdiag.runs.sweep.axes import Axis

Params = dict[str, Scalar]


def cell_key(params: Params) -> str:
    """A folder name for a cell: its values, readable, plus a hash of the full setting."""
    digest = hashlib.sha1(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:6]
    shown = "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", show_scalar(v)) for v in params.values())[:60]
    return f"{shown}-{digest}" if shown else digest


@dataclass
class _Line:
    """One bisection: the bisected axis's values for one setting of the other axes."""

    fixed: Params
    lo: int = 0
    hi: int = -1
    outcome: dict[int, bool] = field(default_factory=dict)   # value index → hung
    asked: set[int] = field(default_factory=set)             # indices handed out
    done: bool = False


class SweepPlan:
    """The cells to run, handed out as results come in (a grid hands out everything at once)."""

    def __init__(self, axes: list[Axis]) -> None:
        self.axes = axes
        self.bisect_axis = next((a for a in axes if a.bisect), None)
        others = [a for a in axes if not a.bisect]
        combos = [dict(zip([a.label for a in others], vals, strict=True))
                  for vals in itertools.product(*(a.values for a in others))] or [{}]
        self._queue: list[Params] = []
        self._lines: list[_Line] = []
        if self.bisect_axis is None:
            self._queue = combos
        else:
            n = len(self.bisect_axis.values)
            for fixed in combos:
                line = _Line(fixed, 0, n - 1)
                self._lines.append(line)
                self._queue += [self._params(line, 0), self._params(line, n - 1)]

    def _params(self, line: _Line, index: int) -> Params:
        assert self.bisect_axis is not None
        out = dict(line.fixed)
        out[self.bisect_axis.label] = self.bisect_axis.values[index]
        # keep the axes' order in the key and tables
        return {a.label: out[a.label] for a in self.axes}

    def planned(self) -> int:
        """Cells this plan runs at most (a bisection: its two ends and log2 of the rest per line)."""
        if self.bisect_axis is None:
            return len(self._queue)
        n = len(self.bisect_axis.values)
        per_line = 2 + max(0, (n - 2).bit_length())
        return len(self._lines) * min(n, per_line)

    def take(self) -> list[Params]:
        """Cells ready to run now (each handed out once)."""
        out, self._queue = self._queue, []
        return out

    def record(self, params: Params, hung: bool) -> None:
        """A cell finished; a bisection may hand out its next cell."""
        if self.bisect_axis is None:
            return
        label = self.bisect_axis.label
        for line in self._lines:
            if line.done or any(params.get(k) != v for k, v in line.fixed.items()):
                continue
            try:
                index = self.bisect_axis.values.index(params[label])
            except ValueError:
                continue
            line.outcome[index] = hung
            self._advance(line)

    def _advance(self, line: _Line) -> None:
        if line.lo not in line.outcome or line.hi not in line.outcome:
            return
        if line.outcome[line.lo] == line.outcome[line.hi] or line.hi - line.lo <= 1:
            line.done = True     # no change of outcome between the ends (assumed monotone), or found
            return
        mid = (line.lo + line.hi) // 2
        if mid not in line.outcome:
            if mid not in line.asked:
                line.asked.add(mid)
                self._queue.append(self._params(line, mid))
            return
        if line.outcome[mid] == line.outcome[line.lo]:
            line.lo = mid
        else:
            line.hi = mid
        self._advance(line)

    def boundaries(self) -> list[tuple[Params, Scalar, Scalar]]:
        """Per finished bisection line whose outcome changes: (other axes' values, last value of the low
        end's outcome, first value of the other)."""
        out: list[tuple[Params, Scalar, Scalar]] = []
        if self.bisect_axis is None:
            return out
        for line in self._lines:
            if line.done and line.outcome.get(line.lo) != line.outcome.get(line.hi):
                out.append((line.fixed, self.bisect_axis.values[line.lo], self.bisect_axis.values[line.hi]))
        return out
