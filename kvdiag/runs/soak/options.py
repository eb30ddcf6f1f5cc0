"""What `kvdiag soak` was asked to do, checked before anything starts, and which engine it launches."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvdiag.capture.locate import url_host_port
from kvdiag.defaults import STALL_WINDOW_S
from kvdiag.errors import UsageError
from kvdiag.launch.vllm import expand
from kvdiag.scenario.loader import load_scenario, parse_scenario
from kvdiag.scenario.models import EngineSpec, Scenario

DEFAULT_SCENARIO = "soak-hybrid.yaml"
VLLM_SCENARIO = "soak-vllm.yaml"


@dataclass
class SoakOptions:
    """Everything `kvdiag soak` was asked to do."""

    # What is loaded: a running server (--url), or an engine kvdiag launches.
    model: str = "sim"                       # "sim", a model folder to `vllm serve`; with --url: the model requested
    url: str | None = None
    scenario: Path | None = None
    allocator: str | None = None             # None: the scenario's
    # The streaming load kvdiag drives.
    duration_s: float = 60.0
    concurrency: int = 32
    max_tokens: int = 256
    chat: bool = False
    read_timeout_s: float = 60.0
    drain_grace_s: float = 5.0               # after --duration: requests in flight get this long to finish
    # Watching it: the stall window, the /metrics period, the capture on a stall.
    stall_window_s: float | None = None      # None: the scenario's windows.stall_s
    metrics_period_s: float = 1.0
    capture: bool = True
    tools: list[str] | None = None           # None: the scenario's capture.tools

    def validate(self) -> None:
        if self.duration_s <= 0:
            raise UsageError("--duration must be > 0")
        if not 1 <= self.concurrency <= 4096:
            raise UsageError("--concurrency must be within 1..4096")
        if self.max_tokens < 1:
            raise UsageError("--max-tokens must be >= 1")
        if not 0 <= self.drain_grace_s <= 600:
            raise UsageError("--drain-grace must be within 0..600 seconds")
        if self.stall_window_s is not None and self.stall_window_s <= 0:
            raise UsageError("--stall-window must be > 0")
        if self.read_timeout_s <= 0:
            raise UsageError("--read-timeout must be > 0")
        if self.read_timeout_s <= (self.stall_window_s or STALL_WINDOW_S):
            raise UsageError("--read-timeout must be longer than the stall window",
                             hint="requests that time out first would hide the stall from the watchdog")
        if self.url is not None:
            try:
                url_host_port(self.url)
            except ValueError:
                raise UsageError(f"--url {self.url!r} is not an http(s) URL",
                                 hint="for example --url http://127.0.0.1:8000") from None
            if self.scenario is not None:
                raise UsageError("--url and --scenario exclude each other",
                                 hint="--url loads a running server; --scenario launches one")
            if self.allocator is not None:
                raise UsageError("--allocator applies to engines kvdiag launches, not to --url",
                                 hint="restart your server with the allocator you want to test")
        elif self.model != "sim" and self.scenario is None and not local_model_dir(self.model):
            raise UsageError(f"--model {self.model!r} is not a model folder on this machine; it needs --url (a "
                             "running server) or --scenario (how to launch it)",
                             hint="--model sim launches the simulated engine; --model DIR launches `vllm serve DIR`")


def request_model(spec: EngineSpec) -> str | None:
    """The model name requests carry: none for the sim, what `vllm serve` was given for a vLLM engine."""
    if spec.kind == "sim":
        return None
    if spec.kind == "vllm":
        return expand(spec.model)
    return spec.model


def local_model_dir(model: str) -> bool:
    """A Hugging Face style model folder here (config.json inside): `kvdiag soak --model DIR` serves it with vLLM."""
    return (Path(expand(model)) / "config.json").is_file()


def load_soak_scenario(path: Path | None, model: str = "sim") -> tuple[Scenario, str, str]:
    """The scenario file, or an embedded default: soak-hybrid (simulated) for ``model`` "sim", else
    soak-vllm serving the model folder ``model`` with real vLLM. Returns (scenario, name, text)."""
    if path is None:
        builtin = DEFAULT_SCENARIO if model == "sim" else VLLM_SCENARIO
        text = resources.files("kvdiag.scenario").joinpath("builtin", builtin).read_text("utf-8")
        name = f"<builtin>/{builtin}"
        scen = parse_scenario(text, name)
        if model != "sim":
            scen.engines[0].model = str(Path(expand(model)).resolve())
        return scen, name, text
    return load_scenario(path)


def single_engine(scenario: Scenario, allocator: str | None, stall_window_s: float | None) -> Scenario:
    """A copy of ``scenario`` with only its first engine (soak drives one engine). A ``serve`` phase stays: it
    is the engine's warm-up before the load (a first request answered, kernels compiled)."""
    first = scenario.engines[0].model_copy(deep=True)
    first.start_after = None
    if allocator is not None and (first.kind == "sim" or (first.kind == "vllm" and first.allocator != "external")):
        first.allocator = allocator  # type: ignore[assignment]
    windows = scenario.windows.model_copy()
    if stall_window_s is not None:
        windows.stall_s = stall_window_s
    return scenario.model_copy(update={"engines": [first], "windows": windows}, deep=True)


__all__ = ["SoakOptions", "load_soak_scenario", "local_model_dir", "request_model", "single_engine"]
