"""`kvdiag capture --pid PID [--out DIR] [--timeout S]`: read-only capture of a live process tree, analyzed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from kvdiag.analyze import analyze, diagnose
from kvdiag.analyze.text import format_verdict
from kvdiag.capture.access import is_kernel_thread
from kvdiag.capture.bundle import capture_tree
from kvdiag.capture.orchestrate import DEFAULT_BACKENDS, make_backends
from kvdiag.capture.select import Scope, capture_scope, engine_cores_of
from kvdiag.errors import UsageError
from kvdiag.fleet.ray import capture_cluster
from kvdiag.model import Bundle, Diagnosis, Finding, ProcessEvidence, ProcessRole
from kvdiag.osread.stat import read_stat
from kvdiag.outputs import RunArtifacts, finish, prepare_out_dir
from kvdiag.redact import redact_bundle


def _target(pid: int | None, engine_core_of: int | None) -> int:
    """The pid to capture: --pid as given, or the one EngineCore under --engine-core-of."""
    if (pid is None) == (engine_core_of is None):
        raise UsageError("give exactly one of --pid PID and --engine-core-of API_SERVER_PID")
    if pid is not None:
        if pid <= 0 or read_stat(pid) is None:
            raise UsageError(f"--pid {pid}: no such process",
                             hint="pass the pid of the EngineCore, or --engine-core-of API_SERVER_PID")
        return pid
    assert engine_core_of is not None
    if engine_core_of <= 0 or read_stat(engine_core_of) is None:
        raise UsageError(f"--engine-core-of {engine_core_of}: no such process")
    cores = engine_cores_of(engine_core_of)
    if not cores:
        raise UsageError(f"--engine-core-of {engine_core_of}: no VLLM::EngineCore process under it",
                         hint="pass the pid of a vLLM API server (`vllm serve`), or --pid of the process itself")
    if len(cores) > 1:
        raise UsageError(f"--engine-core-of {engine_core_of}: {len(cores)} EngineCore processes under it "
                         f"({', '.join(map(str, cores))})", hint="pick one with --pid")
    return cores[0]


def _core_decides(evidence: list[ProcessEvidence], findings: list[Finding]) -> str | None:
    """Whether the engine core's evidence already names its hang (the rest of the tree then needs no
    pausing tool): the reason, else None."""
    v = analyze(Bundle(processes=evidence, findings=findings))
    cores = {e.pid for e in evidence if e.role is ProcessRole.ENGINE_CORE}
    if v.kind.is_hang and any(item.pid in cores for item in v.evidence):
        return f"the EngineCore's evidence decided ({v.kind.value})"
    return None


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
    tools: str = typer.Option(",".join(DEFAULT_BACKENDS), "--tools",
                              help="Comma-separated capture backends: proc, py-spy, pystack, gdb (the default: "
                                   "all four); py-spy-nonblocking (never pauses the target), pystack-locals, "
                                   "gdb-full (every library's symbols)."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as JSON."),
    via: str = typer.Option("auto", "--via", help="How stacks are read: auto (ptrace tools; kvdiag's in-process "
                            "agent where ptrace is refused and the target was started with KVDIAG_AGENT=1) or "
                            "agent (the agent for every process)."),
    follow: bool = typer.Option(True, "--follow/--no-follow", help="Also capture the processes outside the "
                                "tree that a blocked thread waits on (at most 4; the others are named)."),
) -> int:
    """Read-only capture of a live engine (stacks, GIL state, /proc), analyzed.

    Name the process with --pid, or its API server with --engine-core-of.
    A tree that is not one engine (pid 1, your shell, other users' processes)
    is refused unless --all-descendants. py-spy --native, pystack and gdb pause
    the target briefly, one at a time, and always resume it; /proc never does.
    A capture that never pauses: --tools proc,py-spy-nonblocking.
    Before attaching, kvdiag checks that it may read the target (owner, ptrace_scope,
    CAP_SYS_PTRACE, container); when it may not, it says why and the fix (no_access).
    Exit codes: 0 no hang evidence, 10 deadlock or stall found, 4 crash or OOM in its log,
    3 no access (the fix is printed) or no thread could be read, 5 nothing to judge (the
    target exited, is a zombie, is stopped or traced, runs no Python or is a kernel thread),
    6 inconclusive (the evidence that decides is missing, named), 2 bad usage or a refused
    pid, 130 interrupted.
    With --ray, every node of a Ray cluster: one task pinned to each node runs this same capture
    there, and one report covers them all (a node that could not be captured is named, with why).
    """
    if via not in ("auto", "agent"):
        raise UsageError(f"--via {via}: one of auto, agent")
    if via == "agent":
        tools = f"{tools},agent"
    if ray is not None:
        if pid is not None or engine_core_of is not None:
            raise UsageError("--ray captures a cluster: leave out --pid and --engine-core-of")
        return _capture_ray(ray, select, actor, out, timeout, tools, as_json)
    target = _target(pid, engine_core_of)
    if target == os.getpid():
        raise UsageError("--pid: refusing to capture kvdiag itself")
    names = _checked_options(timeout, tools)
    kthread = is_kernel_thread(target)
    if kthread:
        # Refused, but as an outcome with a report (kernel_thread, exit 5), not a scope question:
        # only the named thread is looked at, through /proc, and nothing attaches to it.
        scope = Scope(root=target, pids=[target], problems=[])
    else:
        scope = capture_scope(target)
    if scope.problems and not all_descendants:
        raise UsageError(f"refusing to capture pid {target}: " + "; ".join(scope.problems),
                         hint="name the engine: --engine-core-of API_SERVER_PID (or --pid of its EngineCore); "
                         "--all-descendants captures the whole tree anyway")
    out_dir = prepare_out_dir(out, "capture")
    bundle_dir = out_dir / "bundle"
    if kthread:
        typer.echo(f"pid {target} is a kernel thread: capture refused; recording what /proc shows", err=True)
    else:
        typer.echo(f"capturing pid {target} and its children with {', '.join(names)} "
                   f"(read-only; the tools stop after --timeout {timeout:g} s)", err=True)
    command = (f"capture --engine-core-of {engine_core_of}" if engine_core_of is not None
               else f"capture --pid {target}")

    said: list[str] = []
    known: list[Diagnosis] = []
    paths_said: list[str] = []

    def early(partial: Bundle) -> None:
        # The verdict as soon as the evidence is in; the environment record and the reports follow.
        for f in partial.findings:
            if f.kind == "capture_path":   # which path read it (ptrace tools or the agent), before the verdict
                typer.echo(f.message, err=True)
                paths_said.append(f.message)
        known.append(diagnose(redact_bundle(partial)))
        if not as_json:
            said.append(format_verdict(known[0].verdict))
            typer.echo("\n".join(said[0].splitlines()[:2]), nl=True)
            sys.stdout.flush()
            typer.echo("writing the report", err=True)

    # Ctrl-C and SIGTERM raise here (kvdiag.interrupts): the capture kills its tools on the way out.
    bundle = capture_tree(target, bundle_dir, timeout_s=timeout, backends=names, command=command, pids=scope.pids,
                          save=False, on_evidence=early, decides=_core_decides, follow=follow and not kthread)
    for f in bundle.findings:
        if f.kind == "capture_path" and f.message not in paths_said:
            typer.echo(f.message, err=True)
    # The same tail as every run: redact, analyze, store the diagnosis in the bundle, render it.
    arts = finish(out_dir, bundle, diagnosis=known[0] if known else None)
    return print_outcome(arts, bundle_dir, as_json, said=said[0] if said else None)


def print_outcome(arts: RunArtifacts, bundle_dir: Path, as_json: bool, said: str | None = None) -> int:
    """The outcome on stdout; ``said``: the verdict already printed (its lines are not repeated)."""
    verdict, by_engine, code, paths = arts.verdict, arts.verdicts_by_engine, arts.exit_code, arts.paths
    if as_json:
        typer.echo(json.dumps({"verdict": verdict.model_dump(mode="json"),
                               "verdicts_by_engine": {k: v.model_dump(mode="json") for k, v in by_engine.items()},
                               "bundle": str(bundle_dir), "reports": {k: str(p) for k, p in paths.items()},
                               "exit_code": code}, indent=2))
        return code
    text = format_verdict(verdict, by_engine).splitlines()
    if said and said.splitlines()[:2] == text[:2]:
        text = text[2:]   # the verdict line and its summary are on the screen already
    typer.echo("\n".join(text))
    typer.echo(f"bundle: {bundle_dir}")
    for name, path in paths.items():
        typer.echo(f"{name}: {path}")
    typer.echo(f"exit code {code}")
    return code


def _checked_options(timeout: float, tools: str) -> list[str]:
    """The tool names of ``--tools``, once ``--timeout`` and every name are known good (UsageError if not)."""
    if not 0 < timeout <= 600:
        raise UsageError(f"--timeout {timeout}: must be in (0, 600] seconds")
    names = [t.strip() for t in tools.split(",") if t.strip()]
    try:
        make_backends(names)
    except ValueError as exc:
        raise UsageError(f"--tools: {exc}") from None
    return names


def _capture_ray(address: str, select: str, patterns: list[str], out: Path | None, timeout: float, tools: str,
                 as_json: bool) -> int:
    """``capture --ray``: the same capture on every node of a Ray cluster, merged into one bundle."""
    names = _checked_options(timeout, tools)
    out_dir = prepare_out_dir(out, "capture")
    bundle_dir = out_dir / "bundle"
    bundle = capture_cluster(address, bundle_dir, select=select, patterns=patterns, timeout_s=timeout,
                             backends=names, progress=lambda m: typer.echo(m, err=True))
    return print_outcome(finish(out_dir, bundle), bundle_dir, as_json)


def register(app: typer.Typer) -> None:
    app.command("capture")(capture_cmd)
