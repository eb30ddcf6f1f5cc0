"""What can be checked before anything is launched, refused as a scenario error (exit 2).

A `vllm` engine whose model folder does not exist, or whose Python environment has no `vllm`, would
start, crash within seconds and leave a crash report whose cause is one log line; both are facts of the
host that the scenario names, so the run is refused up front with the file:line, the field and the path.
"""

from __future__ import annotations

import os

from kvdiag.errors import ScenarioError, ToolMissing
from kvdiag.launch.vllm import expand, find_vllm
from kvdiag.scenario.loader import field_line
from kvdiag.scenario.models import Scenario

# A model named like a path (not a hub id such as `facebook/opt-125m`): it must exist on this host.
_PATH_PREFIXES = ("/", "~", "./", "../", "$")


def _is_path(model: str) -> bool:
    return model.startswith(_PATH_PREFIXES) or model in (".", "..")


def check_launchable(scen: Scenario, name: str, text: str) -> None:
    """Raise :class:`ScenarioError` for the first engine that cannot launch on this host."""
    for i, spec in enumerate(scen.engines):
        if spec.kind != "vllm":
            continue
        model = expand(spec.model)
        if _is_path(spec.model) and not os.path.exists(model):
            raise ScenarioError(f"model folder {model} does not exist", name,
                                field_line(text, ("engines", i, "model")), f"engines[{i}].model",
                                hint="point model: at a local model folder (a Hugging Face id such as "
                                     "org/name is fetched by vLLM), or create it with scripts/setup_vllm_cpu.sh")
        try:
            find_vllm(spec.python)
        except ToolMissing as exc:
            where = "python" if spec.python else "python (not set: $KVDIAG_VLLM_VENV, then `vllm` on PATH)"
            raise ScenarioError(str(exc), name, field_line(text, ("engines", i, "python")),
                                f"engines[{i}].{where}", hint=exc.hint) from None
