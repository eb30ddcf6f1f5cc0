"""`kvdiag capture --pid PID [--out DIR] [--timeout S]`: read-only capture of a live process tree, analyzed."""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import typer

from kvdiag.analyze.text import format_verdict
from kvdiag.capture.bundle import capture_tree
from kvdiag.capture.orchestrate import CAPTURE_SLACK_S, DEFAULT_BACKENDS, make_backends
from kvdiag.errors import UsageError
from kvdiag.model import Bundle
from kvdiag.runner import finish


def _default_out() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("reports") / f"capture-{stamp}-{secrets.token_hex(2)}"


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _interruptible(work: Callable[[], Bundle]) -> Bundle:
    """Run ``work`` with SIGTERM turned into KeyboardInterrupt, so the capture kills its tools first."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return work()
    finally:
        signal.signal(signal.SIGTERM, previous)


def capture_cmd(
    pid: int = typer.Option(..., "--pid", help="Process to capture; its children are captured too."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: reports/capture-<timestamp>/)."),
    timeout: float = typer.Option(10.0, "--timeout", help="Bound on the whole capture, seconds."),
    tools: str = typer.Option(",".join(DEFAULT_BACKENDS), "--tools",
                              help="Comma-separated capture backends to run."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as JSON."),
) -> int:
    """Read-only capture of a process and its children (stacks, GIL state, /proc), analyzed.

    py-spy --native, pystack and gdb pause the target briefly while they read it (one at a time,
    bounded by --timeout) and always resume it; /proc never does. For a capture that never pauses:
    --tools proc,py-spy-nonblocking.
    Exit 0 no hang evidence, 10 deadlock found, 4 crash or OOM.
    """
    if pid <= 0 or not os.path.isdir(f"/proc/{pid}"):
        raise UsageError(f"--pid {pid}: no such process", hint="pass the pid of the EngineCore or its API server")
    if pid == os.getpid():
        raise UsageError("--pid: refusing to capture kvdiag itself")
    if not 0 < timeout <= 600:
        raise UsageError(f"--timeout {timeout}: must be in (0, 600] seconds")
    names = [t.strip() for t in tools.split(",") if t.strip()]
    try:
        make_backends(names)
    except ValueError as exc:
        raise UsageError(f"--tools: {exc}") from None
    out_dir = out or _default_out()
    bundle_dir = out_dir / "bundle"
    try:
        bundle_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out_dir}: cannot create: {exc.strerror}") from None
    typer.echo(f"capturing pid {pid} and its children with {', '.join(names)} "
               f"(read-only, at most {timeout + CAPTURE_SLACK_S:.0f}s)", err=True)
    bundle = _interruptible(lambda: capture_tree(pid, bundle_dir, timeout_s=timeout, backends=names,
                                                 command=f"capture --pid {pid}"))
    # The same tail as every run: redact, analyze, store the diagnosis in the bundle, render it.
    arts = finish(out_dir, bundle)
    verdict, by_engine, code, paths = arts.verdict, arts.verdicts_by_engine, arts.exit_code, arts.paths
    if as_json:
        typer.echo(json.dumps({"verdict": verdict.model_dump(mode="json"),
                               "verdicts_by_engine": {k: v.model_dump(mode="json") for k, v in by_engine.items()},
                               "bundle": str(bundle_dir), "reports": {k: str(p) for k, p in paths.items()},
                               "exit_code": code}, indent=2))
        return code
    typer.echo(format_verdict(verdict, by_engine))
    typer.echo(f"bundle: {bundle_dir}")
    for name, path in paths.items():
        typer.echo(f"{name}: {path}")
    typer.echo(f"exit code {code}")
    return code


def register(app: typer.Typer) -> None:
    app.command("capture")(capture_cmd)
