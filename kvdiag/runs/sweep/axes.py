"""`--vary FIELD=VALUES`: which scenario field (or environment variable) an axis sets, its values,
and the scenario of one cell.

Fields:
- a scenario path: ``engines.<name>.sim.min_reserved_pages``, ``engines.<name>.prealloc``,
  ``windows.stall_s``, ``device.size_gb`` (engines are addressed by name);
- an environment variable: ``engines.<name>.env.NAME`` for one engine, ``env.NAME`` for every engine;
- shorthands for every engine: ``prealloc`` and ``allocator`` (the latter, like `repro --allocator`,
  only where kvdiag's allocator runs: simulated engines and vLLM engines with kvdiag's plugin).

Values: ``a,b,c``; integer ranges ``1..10`` or ``2..40:2`` (step); ``on``/``off`` for yes/no fields.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ValidationError

from kvdiag.errors import UsageError
from kvdiag.model.sweep import Scalar, SweepAxis
from kvdiag.scenario.models import EngineSpec, Scenario

_RANGE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*\.\.\s*(-?\d+(?:\.\d+)?)\s*(?::\s*(\d+(?:\.\d+)?))?\s*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_VALUES = 1000
_TRUE = ("on", "true", "yes", "1")
_FALSE = ("off", "false", "no", "0")
_GLOBAL_SHORTHANDS = ("prealloc", "allocator")


@dataclass(frozen=True)
class FieldRef:
    """Where an axis writes: a path into the scenario's data, on one engine or on every engine."""

    text: str                          # as the user wrote it
    path: tuple[str, ...]              # below the engine (or the scenario when engine is None)
    engine: str | None = None          # one engine by name; None with every_engine=False: scenario level
    every_engine: bool = False
    annotation: Any = str              # the pydantic type of the field, for parsing values


@dataclass
class Axis:
    ref: FieldRef
    values: list[Scalar]
    label: str
    bisect: bool = False

    def model(self) -> SweepAxis:
        return SweepAxis(field=self.ref.text, values=list(self.values), label=self.label, bisect=self.bisect)


@dataclass
class CellScenario:
    scenario: Scenario
    notes: list[str] = field(default_factory=list)


def _unwrap(annotation: Any) -> Any:
    """``int | None`` → int; other annotations unchanged."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return annotation


def _model_field(model: type[BaseModel], path: tuple[str, ...], full: str) -> Any:
    """The annotation at ``path`` below ``model``; an unknown name is a usage error naming it."""
    cur: Any = model
    for i, name in enumerate(path):
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            fields = cur.model_fields
            if name not in fields:
                close = difflib.get_close_matches(name, list(fields), n=3)
                where = ".".join(path[:i]) or "the scenario"
                raise UsageError(
                    f"--vary {full}: unknown field {name!r} in {where}",
                    hint=(f"did you mean {', '.join(close)}? " if close else "")
                    + f"fields there: {', '.join(sorted(fields))}")
            cur = _unwrap(fields[name].annotation)
            continue
        if typing.get_origin(cur) is dict:
            if i != len(path) - 1 or not _ENV_NAME.match(name):
                raise UsageError(f"--vary {full}: {'.'.join(path[:i])} takes one variable name (NAME)")
            return str
        raise UsageError(f"--vary {full}: {'.'.join(path[:i])} has no field {name!r}")
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        raise UsageError(f"--vary {full}: {'.'.join(path)} is a section, not a field",
                         hint=f"name one of its fields: {', '.join(sorted(cur.model_fields))}")
    if typing.get_origin(cur) in (dict, list) or cur in (dict, list):
        raise UsageError(f"--vary {full}: {'.'.join(path)} is a list or mapping, not a value",
                         hint="vary one environment variable with engines.NAME.env.VAR or env.VAR")
    return cur


def resolve_field(text: str, scenario: Scenario) -> FieldRef:
    """Resolve a ``--vary`` field against the scenario (engine names) and its models (field names)."""
    parts = tuple(p for p in text.strip().split("."))
    if not text.strip() or any(not p for p in parts):
        raise UsageError(f"--vary {text}=...: empty field name")
    if parts[0] in _GLOBAL_SHORTHANDS and len(parts) == 1:
        return FieldRef(text, parts, every_engine=True, annotation=_model_field(EngineSpec, parts, text))
    if parts[0] == "env":
        if len(parts) != 2 or not _ENV_NAME.match(parts[1]):
            raise UsageError(f"--vary {text}: env.NAME sets one environment variable on every engine")
        return FieldRef(text, ("env", parts[1]), every_engine=True, annotation=str)
    if parts[0] == "engines":
        names = [e.name for e in scenario.engines]
        if len(parts) < 3:
            raise UsageError(f"--vary {text}: name an engine and its field (engines.<name>.<field>)",
                             hint=f"engines in this scenario: {', '.join(names)}")
        if parts[1] not in names:
            close = difflib.get_close_matches(parts[1], names, n=2)
            raise UsageError(f"--vary {text}: no engine named {parts[1]!r} in the scenario",
                             hint=(f"did you mean {', '.join(close)}? " if close else "")
                             + f"engines: {', '.join(names)}")
        sub = parts[2:]
        return FieldRef(text, sub, engine=parts[1], annotation=_model_field(EngineSpec, sub, text))
    if parts[0] in Scenario.model_fields and parts[0] != "engines":
        return FieldRef(text, parts, annotation=_model_field(Scenario, parts, text))
    known = ["engines.<name>.<field>", "env.<VAR>", *_GLOBAL_SHORTHANDS,
             *(f"{k}.<field>" for k in Scenario.model_fields if k not in ("engines", "name", "description"))]
    close = difflib.get_close_matches(parts[0], [*Scenario.model_fields, *_GLOBAL_SHORTHANDS, "env"], n=2)
    raise UsageError(f"--vary {text}: unknown field {text!r}",
                     hint=(f"did you mean {', '.join(close)}? " if close else "") + f"fields: {', '.join(known)}")


def _number(text: str) -> int | float:
    return float(text) if "." in text else int(text)


def _expand(values_text: str, full: str) -> list[str | int | float]:
    """``a,b`` and ``lo..hi[:step]`` (inclusive) into raw values."""
    out: list[str | int | float] = []
    for item in values_text.split(","):
        item = item.strip()
        if not item:
            raise UsageError(f"--vary {full}: empty value")
        m = _RANGE.match(item)
        if m is None:
            out.append(item)
            continue
        lo, hi = _number(m.group(1)), _number(m.group(2))
        step = _number(m.group(3)) if m.group(3) else 1
        if step <= 0 or hi < lo:
            raise UsageError(f"--vary {full}: range {item} is empty (write lo..hi with lo <= hi and a step > 0)")
        count = int(round((hi - lo) / step)) + 1
        if count > MAX_VALUES:
            raise UsageError(f"--vary {full}: range {item} has {count} values (at most {MAX_VALUES})")
        floats = any(isinstance(x, float) for x in (lo, hi, step))
        out.extend(round(lo + i * step, 6) if floats else int(lo + i * step) for i in range(count)
                   if lo + i * step <= hi + 1e-9)
    return out


def _coerce(raw: str | int | float, annotation: Any, full: str) -> Scalar:
    """One value of the field's type; a value the type cannot take is a usage error."""
    ann = _unwrap(annotation)
    text = str(raw)
    if ann is bool:
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise UsageError(f"--vary {full}: {text!r} is not on/off")
    if ann is int:
        if isinstance(raw, float) and not raw.is_integer():
            raise UsageError(f"--vary {full}: {text!r} is not a whole number")
        try:
            return int(float(text)) if isinstance(raw, float) else int(text)
        except ValueError:
            raise UsageError(f"--vary {full}: {text!r} is not a whole number") from None
    if ann is float:
        try:
            return float(text)
        except ValueError:
            raise UsageError(f"--vary {full}: {text!r} is not a number") from None
    if typing.get_origin(ann) is Literal:
        choices = [str(c) for c in typing.get_args(ann)]
        if text not in choices:
            raise UsageError(f"--vary {full}: {text!r} is not one of {', '.join(choices)}")
        return text
    return text


def parse_vary(spec: str, scenario: Scenario, *, bisect: bool = False) -> Axis:
    """``FIELD=VALUES`` into an :class:`Axis` checked against ``scenario``."""
    flag = "--bisect" if bisect else "--vary"
    if "=" not in spec:
        raise UsageError(f"{flag} {spec}: expected FIELD=VALUES (e.g. engines.vlm.sim.min_reserved_pages=1..10)")
    field_text, values_text = spec.split("=", 1)
    ref = resolve_field(field_text, scenario)
    values = [_coerce(v, ref.annotation, spec) for v in _expand(values_text, spec)]
    seen: list[Scalar] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    if bisect:
        if _unwrap(ref.annotation) not in (int, float) or any(isinstance(v, bool) for v in seen):
            raise UsageError(f"--bisect {spec}: bisection needs a numeric field")
        if len(seen) < 2:
            raise UsageError(f"--bisect {spec}: give a range (lo..hi) to bisect")
        seen.sort()
    label = ref.path[-1]
    return Axis(ref, seen, label, bisect)


def unique_labels(axes: list[Axis]) -> None:
    """Labels are the fields' last names; where two axes share one, the full path is used instead."""
    counts: dict[str, int] = {}
    for a in axes:
        counts[a.label] = counts.get(a.label, 0) + 1
    for a in axes:
        if counts[a.label] > 1:
            a.label = a.ref.text
    texts = [a.ref.text for a in axes]
    dup = {t for t in texts if texts.count(t) > 1}
    if dup:
        raise UsageError(f"--vary {sorted(dup)[0]} is given twice")


def _set(target: dict[str, Any], path: tuple[str, ...], value: Scalar) -> None:
    cur = target
    for name in path[:-1]:
        nxt = cur.get(name)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[name] = nxt
        cur = nxt
    cur[path[-1]] = value


def _env_value(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def cell_scenario(base: Scenario, axes: list[Axis], values: dict[str, Scalar]) -> CellScenario:
    """The scenario of one cell: ``base`` with each axis set to ``values[label]``.

    ``min_reserved_pages`` above ``max_reserved_pages`` is not a valid pool; when only the minimum is
    varied, the maximum is raised with it (and the cell says so) rather than the cell refused.
    """
    data = base.model_dump(mode="json")
    varied: set[tuple[str | None, tuple[str, ...]]] = set()
    for axis in axes:
        value = values[axis.label]
        ref = axis.ref
        engines: list[dict[str, Any]] = data["engines"]
        if ref.every_engine:
            for e in engines:
                if ref.path == ("allocator",) and not (e["kind"] == "sim" or
                                                       (e["kind"] == "vllm" and e["allocator"] != "external")):
                    continue
                v: Scalar = _env_value(value) if ref.path[0] == "env" else value
                _set(e, ref.path, v)
                varied.add((e["name"], ref.path))
        elif ref.engine is not None:
            e = next(x for x in engines if x["name"] == ref.engine)
            _set(e, ref.path, _env_value(value) if ref.path[0] == "env" else value)
            varied.add((ref.engine, ref.path))
        else:
            _set(data, ref.path, value)
    notes: list[str] = []
    for e in data["engines"]:
        for section in (("sim",), ("vllm", "pool")):
            pool = e
            for name in section:
                pool = pool[name]
            if pool["min_reserved_pages"] > pool["max_reserved_pages"] and \
                    (e["name"], (*section, "max_reserved_pages")) not in varied:
                notes.append(f"{e['name']}: max_reserved_pages raised from {pool['max_reserved_pages']} to "
                             f"{pool['min_reserved_pages']} (min_reserved_pages may not exceed it)")
                pool["max_reserved_pages"] = pool["min_reserved_pages"]
    try:
        scen = Scenario.model_validate(copy.deepcopy(data))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        raise UsageError(f"sweep cell {shown}: invalid scenario: {where}: {err['msg']}",
                         hint="narrow the --vary values to ones the field accepts") from None
    return CellScenario(scen, notes)
