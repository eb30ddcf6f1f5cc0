"""Scenario loader: valid files load, every invalid one names file:line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.errors import ScenarioError
from kvdiag.scenario.loader import load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_scenarios_load(path: Path) -> None:
    scenario, name, _ = load_scenario(path)
    assert scenario.engines and name == str(path)
    assert [e.name for e in scenario.ordered_engines()]


def test_embedded_default_has_the_seed_parameters() -> None:
    scenario, name, _ = load_scenario(None)
    assert name.startswith("<builtin>")
    coder, vlm = scenario.ordered_engines()
    assert (coder.sim.layers, coder.sim.kv_per_layer_mb, coder.sim.max_reserved_pages) == (64, 283, 10)
    assert (vlm.sim.layers, vlm.sim.kv_per_layer_mb, vlm.sim.max_reserved_pages) == (28, 11, 5)
    assert vlm.start_after == "coder" and vlm.allocator == "stock" and vlm.prealloc is True


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        ("engines:\n  - name: a\n    bogus: 1\n", 3, "engines[0].bogus", "unknown key"),
        ("engines:\n  - name: a\n    port: nope\n", 3, "engines[0].port", "integer"),
        ("engines:\n  - name: a\n    sim:\n      layers: 0\n", 4, "engines[0].sim.layers", "greater"),
        ("windows: {stall_s: 5}\n", 1, "engines", "required"),
        ("engines:\n  - name: a\n  - name: a\n", 1, None, "unique"),
        ("engines:\n  - name: a\n    start_after: zz\n", 1, None, "unknown engine"),
        ("engines:\n  - name: a\n    ready: 'log:('\n", 3, "engines[0].ready", "regex"),
        ("engines:\n  - name: a\n    kind: command\n", 2, None, "need a command"),
        ("engines:\n  - name: a\n    env: {1BAD: x}\n", 3, "engines[0].env", "environment"),
    ],
)
def test_errors_name_line_and_field(text: str, line: int, field: str | None, words: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, "s.yaml")
    err = info.value
    assert err.file == "s.yaml"
    assert err.line == line, err.message
    if field:
        assert err.field == field
    assert words in err.message


def test_malformed_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario("engines: [\n  {name: a\n", "bad.yaml")
    assert info.value.line is not None and "malformed YAML" in info.value.message
    with pytest.raises(ScenarioError) as info2:
        load_scenario(tmp_path / "nope.yaml")
    assert "not found" in info2.value.message


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_loader_only_raises_scenario_errors(text: str) -> None:
    try:
        parse_scenario(text, "fuzz.yaml")
    except ScenarioError as exc:
        assert exc.message.startswith("fuzz.yaml")


_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                       max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["name", "kind", "port", "sim", "env", "ready", "start_after", "x"]),
                       _values, max_size=5))
def test_fuzz_engine_fields(engine: dict[str, object]) -> None:
    import yaml

    text = yaml.safe_dump({"engines": [engine]})
    try:
        parse_scenario(text, "f.yaml")
    except ScenarioError as exc:
        assert exc.file == "f.yaml"
