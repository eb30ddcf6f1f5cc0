"""`kvdiag capture --pid PID [--out DIR] [--timeout S]`: read-only capture of a live process tree, analyzed."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli.common import EarlyVerdict, print_outcome
from kvdiag.defaults import DEFAULT_TOOLS
from kvdiag.errors import UsageError
from kvdiag.runs.capture import capture_cluster_run, capture_run, checked_tools, scope_of, target_pid
from kvdiag.runs.outdir import prepare_out_dir


def capture_cmd(
    ray: str | None = typer.Option(None, "--ray", metavar="[ADDRESS]",
                                   help="Capture the selected processes on every node of a Ray cluster (default "
                                   "address: the cluster `ray` would connect to); needs `pip install "
                                   "'kvdiag[ray]'`.", show_default=False),
    select: str = typer.Option("vllm", "--select", help="With --ray: vllm (vLLM's Ray actors and drivers; every "
                               "actor when there is none), actors (every actor) or workers (every worker)."),
    actor: list[str] = typer.Option([], "--actor", metavar="PATTERN", help="With --ray: only the actors whose "
                                    "class or name matches this shell pattern (repeatable)."),
    pid: int | None = typer.Option(None, "--pid", help="Process to capture; its children are captured too.",
                                   show_default=False),
    engine_core_of: int | None = typer.Option(None, "--engine-core-of", metavar="API_SERVER_PID",
                                              help="Capture the EngineCore (VLLM::EngineCore) under this API "
                                              "server instead of naming a pid.", show_default=False),
    all_descendants: bool = typer.Option(False, "--all-descendants", help="Capture a tree that is not one "
                                         "engine (pid 1, a shell, other users' processes): every process in it "
                                         "is paused briefly."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: reports/capture-<timestamp>/)."),
    timeout: float = typer.Option(10.0, "--timeout", help="Seconds the capture tools may take in all; "
                                  "analysis and the report follow."),
    tools: str = typer.Option(",".join(DEFAULT_TOOLS), "--tools",
                              help="Comma-separated capture backends: proc, py-spy, pystack, gdb (the default: "
                                   "all four); py-spy-nonblocking (never pauses the target), pystack-locals, "
                                   "gdb-full (every library's symbols)."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as JSON."),
    follow: bool = typer.Option(True, "--follow/--no-follow", help="Also capture the processes outside the "
                                "tree that a blocked thread waits on (at most 4; the others are named)."),
    via: str = typer.Option("auto", "--via", help="How stacks are read: auto (ptrace tools; kvdiag's in-process "
                            "agent where ptrace is refused and the target runs with KVDIAG_AGENT=1) or agent."),
) -> int:
    """Read-only capture of a live engine (stacks, GIL state, /proc), analyzed.

    Name the process with --pid, or its API server with --engine-core-of.
    A tree that is not one engine (pid 1, your shell, other users' processes)
    is refused unless --all-descendants. The stack tools pause the target briefly, one
    at a time; /proc never does. kvdiag checks it may read the target first, else says
    why and the fixes (no_access).
    Exit codes: 0 no hang evidence, 10 deadlock or stall found, 4 crash or OOM in its log,
    3 no access (the fix is printed) or no thread could be read, 5 nothing to judge (the
    target exited, is a zombie, is stopped or traced, runs no Python or is a kernel thread),
    6 inconclusive (the evidence that decides is missing, named), 2 bad usage or a refused
    pid, 130 interrupted.
    With --ray, every node of a Ray cluster: one task pinned to each node runs this same capture
    there, and one report covers them all (a node that could not be captured is named, with why).
    """
    if ray is not None:
        if pid is not None or engine_core_of is not None:
            raise UsageError("--ray captures a cluster: leave out --pid and --engine-core-of")
        names = checked_tools(timeout, tools, via)
        arts = capture_cluster_run(ray, prepare_out_dir(out, "capture"), select=select, patterns=actor,
                                   timeout_s=timeout, tools=names, progress=lambda m: typer.echo(m, err=True))
        return print_outcome(arts, as_json)
    target = target_pid(pid, engine_core_of)
    names = checked_tools(timeout, tools, via)
    scope = scope_of(target, all_descendants)
    command = f"capture --engine-core-of {engine_core_of}" if engine_core_of is not None else f"capture --pid {target}"
    said = EarlyVerdict(as_json)
    arts = capture_run(target, scope, prepare_out_dir(out, "capture"), timeout_s=timeout, tools=names,
                       command=command, follow=follow, on_verdict=said, progress=lambda m: typer.echo(m, err=True))
    return print_outcome(arts, as_json, said=said.text)


def register(app: typer.Typer) -> None:
    app.command("capture")(capture_cmd)
