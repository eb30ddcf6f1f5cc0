"""Entry point: builds the typer app and maps KvdiagError to exit codes, once."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from types import FrameType

import typer

from kvdiag import __version__
from kvdiag.errors import ExitCode, KvdiagError, Terminated

# Each module defines ``register(app)`` adding its command(s).
_COMMAND_MODULES = ("repro", "soak", "ab", "capture", "analyze", "report", "banner", "sim", "redact")

app = typer.Typer(
    name="kvdiag",
    help="Reproduce, capture and diagnose kvcached/vLLM engine hangs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version_cb(value: bool) -> None:
    if value:
        typer.echo(f"kvdiag {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_version_cb, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    if debug:
        os.environ["KVDIAG_DEBUG"] = "1"


def _register_all() -> None:
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"kvdiag.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"kvdiag.cli.{name}":
                continue  # command not built yet
            raise
        module.register(app)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"received {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (also used as sys.exit)."""
    if threading.current_thread() is threading.main_thread():
        # SIGTERM/SIGHUP end a run like Ctrl-C does: teardown, partial report, exit 130.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _on_sigterm)
        # Started as a background job of a script, kvdiag inherits SIGINT ignored and Python then
        # installs no KeyboardInterrupt handler; `kill -INT` must still end the run cleanly.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    debug = "--debug" in (argv if argv is not None else sys.argv[1:]) or os.environ.get("KVDIAG_DEBUG") == "1"
    try:
        _register_all()
        rv = app(args=argv, standalone_mode=False)
    except KvdiagError as exc:
        if debug:
            raise
        typer.echo(f"kvdiag: error: {exc.message}", err=True)
        if exc.hint:
            typer.echo(f"  hint: {exc.hint}", err=True)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        typer.echo(f"kvdiag: interrupted{': ' + str(exc) if str(exc) else ''}", err=True)
        return ExitCode.INTERRUPTED
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except SystemExit as exc:  # click usage errors in standalone_mode=False still raise these
        code = exc.code if isinstance(exc.code, int) else ExitCode.USAGE
        return code
    except Exception as exc:  # a bug: one line unless --debug
        import click

        if isinstance(exc, click.exceptions.Abort):
            typer.echo("kvdiag: interrupted", err=True)
            return ExitCode.INTERRUPTED
        if isinstance(exc, click.ClickException):
            exc.show()
            return ExitCode.USAGE
        if debug:
            raise
        typer.echo(f"kvdiag: internal error: {type(exc).__name__}: {exc} (rerun with --debug)", err=True)
        return ExitCode.FAILED
    return rv if isinstance(rv, int) else 0


def run() -> None:
    """Console-script entry point."""
    try:
        code = main()
    except KeyboardInterrupt:  # landed between main's handlers and here
        code = ExitCode.INTERRUPTED
    # The run is over and its outputs are written: a late Ctrl-C or SIGTERM must not turn that
    # exit status into a death by signal during interpreter shutdown. One that lands before the
    # handlers are swapped raises here; once SIG_IGN is in place a still-pending one is dropped.
    while True:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            break
        except KeyboardInterrupt:
            continue
    sys.exit(code)


if __name__ == "__main__":
    run()
