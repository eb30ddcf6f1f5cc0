"""Which Python interpreter each scenario engine runs, before it starts.

The environment record reads package versions and the kvcached build from the
engines' own interpreters (a vLLM venv is not kvdiag's interpreter); this says
which interpreter that is. ``sim`` engines run kvdiag's own Python and are not listed.
"""

from __future__ import annotations

from kvdiag.launch.vllm import engine_python
from kvdiag.scenario.models import EngineSpec, Scenario


def engine_interpreter(spec: EngineSpec) -> str | None:
    """The interpreter ``spec`` runs, when it is known to be Python; None otherwise."""
    if spec.kind == "vllm":
        return engine_python(spec.python)
    return None


def engine_interpreters(scenario: Scenario) -> list[tuple[str, str]]:
    """(engine name, interpreter path) of every engine whose Python is known before launch."""
    out: list[tuple[str, str]] = []
    for spec in scenario.ordered_engines():
        python = engine_interpreter(spec)
        if python:
            out.append((spec.name, python))
    return out
