"""The typer app: the root options and the commands, each loaded only when it runs."""

from __future__ import annotations

import importlib
import os

import typer

from kvdiag import __version__

# Each module defines ``register(app)`` adding its command(s).
_COMMAND_MODULES = ("repro", "soak", "ab", "capture", "analyze", "report", "banner", "doctor", "sim", "redact",
                    "watch", "sweep", "merge")

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


def register_all(argv: list[str] | None = None) -> None:
    """Add the commands to the app: only the one ``argv`` names when it names one (a command imports
    only what it needs: `kvdiag capture` starts without loading the launcher), else all (help, usage)."""
    named = [a for a in (argv or []) if not a.startswith("-")][:1]
    names = named if named and named[0] in _COMMAND_MODULES else _COMMAND_MODULES
    for name in names:
        try:
            module = importlib.import_module(f"kvdiag.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"kvdiag.cli.{name}":
                continue  # command not built yet
            raise
        module.register(app)
