"""`kvdiag soak`: single-engine saturation load with a no-progress watchdog."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from kvdiag.cli.common import console, print_outcome, result_console
from kvdiag.defaults import STALL_WINDOW_S
from kvdiag.report.soakview import soak_lines
from kvdiag.runs.outdir import prepare_out_dir
from kvdiag.runs.soak.options import SoakOptions
from kvdiag.runs.soak.session import SoakRun
from kvdiag.scenario.loader import load_scenario


class AllocatorChoice(str, Enum):
    stock = "stock"
    fixed = "fixed"


def soak(
    model: str = typer.Option("sim", "--model", "-m", help="Model to load. 'sim' launches the embedded simulated "
                              "engine (no GPU); a model folder launches `vllm serve DIR` (real vLLM, embedded "
                              "soak-vllm scenario); with --url, the model name requests use (default: the first "
                              "one the server lists)."),
    url: str | None = typer.Option(None, "--url", help="Drive an already running OpenAI-compatible server "
                                   "(e.g. http://127.0.0.1:8000) instead of launching one."),
    scenario: Path | None = typer.Option(None, "--scenario", "-s", help="Scenario YAML whose first engine is "
                                         "launched (default: embedded soak-hybrid: one engine whose KV pool "
                                         "fills under load, kvcached #371's runtime stall)."),
    duration: float = typer.Option(60.0, "--duration", "-d", help="Seconds of load when nothing stalls; then no "
                                   "new request is sent."),
    drain_grace: float = typer.Option(5.0, "--drain-grace", help="After --duration, requests in flight get up to "
                                      "this many seconds to finish; the rest are cancelled."),
    concurrency: int = typer.Option(32, "--concurrency", "-c", help="Concurrent streaming requests."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="max_tokens of each request (sent with ignore_eos)."),
    allocator: AllocatorChoice | None = typer.Option(None, "--allocator", help="Allocator of the launched "
                                                     "simulated engine (default: the scenario's, stock)."),
    stall_window: float | None = typer.Option(None, "--stall-window", help="Requests in flight and no token for "
                                              "this many seconds is a stall (default: the scenario's, "
                                              f"{STALL_WINDOW_S:g})."),
    chat: bool = typer.Option(False, "--chat", help="Use /v1/chat/completions instead of /v1/completions."),
    read_timeout: float = typer.Option(60.0, "--read-timeout", help="A request that receives no byte for this "
                                       "long ends as timed out."),
    capture: bool = typer.Option(True, "--capture/--no-capture", help="Capture the engine's stacks on a stall."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: reports/soak-<timestamp>)."),
) -> int:
    """Saturate one engine with streaming requests and watch for a decode stall.

    Exit codes: 0 tokens kept flowing with the KV cache near full, 10 decode stalled,
    6 nothing stalled but the KV cache never got near full (inconclusive), 4 the engine
    failed, 2 bad usage or scenario, 130 interrupted.
    """
    opts = SoakOptions(model=model, url=url, scenario=scenario, duration_s=duration, concurrency=concurrency,
                       max_tokens=max_tokens, allocator=allocator.value if allocator else None,
                       stall_window_s=stall_window, chat=chat, read_timeout_s=read_timeout, capture=capture,
                       drain_grace_s=drain_grace)
    opts.validate()  # usage errors before any folder is created
    if scenario is not None and url is None:
        load_scenario(scenario)  # an invalid scenario file is a usage error, before any folder exists
    out_dir = prepare_out_dir(out, "soak")
    con = console()
    subject = (url if url else f"scenario {scenario}" if scenario else "simulated engine (soak-hybrid)"
               if model == "sim" else f"vllm serve {model} (soak-vllm)")
    con.print(f"kvdiag soak: {subject}, {concurrency} streams, output {out_dir}", highlight=False)
    arts = SoakRun(opts, out_dir, con).run()
    result = result_console()
    if arts.bundle.soak is not None:
        for line in soak_lines(arts.bundle.soak):   # the verdict block below says stall → verdict
            result.print(line, highlight=False, markup=False)
    return print_outcome(arts, con=result)


def register(app: typer.Typer) -> None:
    app.command("soak")(soak)
