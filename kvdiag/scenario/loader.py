"""Load a scenario YAML into models; every error names file:line and the field."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvdiag.errors import ScenarioError
from kvdiag.scenario.models import Scenario

DEFAULT_SCENARIO = "two-engine.yaml"

Loc = tuple[str | int, ...]


def _to_python(node: yaml.Node, path: Loc, lines: dict[Loc, int], file: str) -> Any:
    """Convert a composed YAML node to Python, recording each path's 1-based line."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _to_python(key_node, path + ("<key>",), lines, file)
            if not isinstance(key, (str, int)):
                raise ScenarioError("mapping keys must be strings", file, key_node.start_mark.line + 1)
            if key in out:
                raise ScenarioError("duplicate key", file, key_node.start_mark.line + 1, _dotted(path + (key,)))
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _to_python(value_node, path + (key,), lines, file)
            lines[path + (key,)] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(item, path + (i,), lines, file) for i, item in enumerate(node.value)]
    assert isinstance(node, yaml.ScalarNode)
    return yaml.SafeLoader.construct_object(_SCALAR_LOADER, node, deep=True)


class _ScalarLoader(yaml.SafeLoader):
    def __init__(self) -> None:
        super().__init__("")


_SCALAR_LOADER = _ScalarLoader()


def _dotted(loc: Loc) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        else:
            parts.append(("." if parts else "") + p)
    return "".join(parts)


def _line_for(loc: Loc, lines: dict[Loc, int]) -> int | None:
    for cut in range(len(loc), -1, -1):
        if loc[:cut] in lines:
            return lines[loc[:cut]]
    return None


def parse_scenario(text: str, file: str = "<scenario>") -> Scenario:
    """Parse and validate scenario ``text``; raises ScenarioError naming file:line and field."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise ScenarioError(f"malformed YAML: {exc.problem or exc}", file, line) from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"malformed YAML: {exc}", file) from None
    if node is None:
        raise ScenarioError("empty scenario", file, 1)
    lines: dict[Loc, int] = {}
    try:
        data = _to_python(node, (), lines, file)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"malformed YAML: {exc}", file) from None
    if not isinstance(data, dict):
        raise ScenarioError("a scenario is a mapping (engines:, windows:, ...)", file, 1)
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc: Loc = tuple(err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required field is missing"
        return _raise(msg, file, _line_for(loc, lines), _dotted(loc) or None)


def _raise(msg: str, file: str, line: int | None, field: str | None) -> Scenario:
    raise ScenarioError(msg, file, line, field)


def field_line(text: str, loc: Loc) -> int | None:
    """The 1-based line of field ``loc`` (``("engines", 0, "model")``) in scenario ``text``, or of the
    nearest enclosing field that is written there (a field left to its default has no line of its own)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        lines: dict[Loc, int] = {}
        if node is not None:
            _to_python(node, (), lines, "<scenario>")
    except (yaml.YAMLError, ScenarioError):
        return None
    return _line_for(loc, lines)


# The repository's scenarios/*.yaml travel in the package (CMakeLists.txt installs them here), so the
# names the README uses work from an installed wheel too; a checkout has them beside the package.
SHIPPED_DIR = "shipped"
DEFAULT_NAMES = ("default", "two-engine")


def shipped_scenarios() -> dict[str, Path]:
    """Scenario name (file stem) → file, of the scenarios that come with kvdiag."""
    found: dict[str, Path] = {}
    here = Path(__file__).resolve().parent
    # The repository's folder links two of its files to the embedded defaults; an install keeps no
    # links, so the embedded folders are read too.
    folders = (here.parents[1] / "scenarios", here / SHIPPED_DIR, here / "builtin")
    for folder in folders:
        if folder.is_dir():
            for f in sorted(folder.glob("*.yaml")):
                if f.is_file():
                    found.setdefault(f.stem, f)
    return found


def _shipped(path: Path) -> Path | None:
    """The shipped scenario a missing ``path`` names: `two-engine`, `two-engine.yaml` or
    `scenarios/two-engine.yaml` (as the README writes it, from any folder)."""
    parent = path.parent.as_posix()
    if parent not in (".", "scenarios") or path.suffix not in ("", ".yaml"):
        return None
    return shipped_scenarios().get(path.name.removesuffix(".yaml"))


def load_scenario(path: Path | None) -> tuple[Scenario, str, str]:
    """Load a scenario file, a shipped scenario by name, or the embedded default (``None``, `default`,
    `two-engine`). Returns (scenario, source name, text)."""
    if path is not None and not path.exists() and str(path) in DEFAULT_NAMES:
        path = None
    if path is None:
        text = resources.files("kvdiag.scenario").joinpath("builtin", DEFAULT_SCENARIO).read_text("utf-8")
        name = f"<builtin>/{DEFAULT_SCENARIO}"
    else:
        if not path.exists():
            shipped = _shipped(path)
            if shipped is not None:
                path = shipped
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            names = ", ".join(sorted(shipped_scenarios())) or "none found"
            raise ScenarioError("file not found", str(path),
                                hint=f"a file, or one of the shipped scenarios by name: {names}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ScenarioError(f"cannot read: {exc}", str(path)) from None
        name = str(path)
    return parse_scenario(text, name), name, text
