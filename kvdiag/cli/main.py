"""Entry point: builds the typer app and maps KvdiagError to exit codes, once."""

from __future__ import annotations

import importlib
import os
import sys

import click
import typer

from kvdiag import __version__, interrupts
from kvdiag.errors import ExitCode, Interrupted, KvdiagError

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


def _register_all(argv: list[str] | None = None) -> None:
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


def _classes(*dotted: str) -> tuple[type[BaseException], ...]:
    """The exception classes named ``module:Class`` that this install has (others are skipped)."""
    found: list[type[BaseException]] = []
    for name in dotted:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr, None)
        except ImportError:
            continue
        if isinstance(cls, type) and issubclass(cls, BaseException) and cls not in found:
            found.append(cls)
    return tuple(found)


def _cli_usage_types() -> tuple[type[BaseException], ...]:
    """Bad-usage exceptions of the CLI library: click's, and the copies typer >= 0.26 vendors as
    ``typer._click`` (not subclasses of click's: an ``except click.ClickException`` misses them).
    pyproject pins typer/click; both families are listed so a drifted install still exits 2."""
    return _classes("click.exceptions:ClickException", "typer._click.exceptions:ClickException")


def _cli_abort_types() -> tuple[type[BaseException], ...]:
    return _classes("click.exceptions:Abort", "typer._click.exceptions:Abort", "typer.exceptions:Abort")


def _show_usage_error(exc: BaseException, argv: list[str]) -> None:
    """click's own rendering (usage line, "Try ... --help", "Error: ..."); click leaves out the usage
    line for some errors (an option missing its value): then it is built from the command named."""
    if getattr(exc, "ctx", None) is None:
        usage = _usage_of(argv)
        if usage:
            typer.echo(usage, err=True)
    if "Did you mean" in str(getattr(exc, "message", "")) and getattr(exc, "possibilities", None):
        # typer writes its suggestion into the message and click appends its own: say it once
        exc.possibilities = None   # type: ignore[attr-defined]
    show = getattr(exc, "show", None)
    if callable(show):
        show()
    else:
        typer.echo(f"kvdiag: error: {exc}", err=True)


def _usage_of(argv: list[str]) -> str | None:
    """"Usage: kvdiag CMD [OPTIONS]..." and the --help hint for the deepest command ``argv`` names."""
    try:
        cmd: click.Command = typer.main.get_command(app)
        path = ["kvdiag"]
        for token in argv:
            sub = getattr(cmd, "commands", {}).get(token)
            if sub is None:
                if not token.startswith("-"):
                    break
                continue
            cmd, path = sub, [*path, token]
        ctx = click.Context(cmd, info_name=" ".join(path))
        return f"{cmd.get_usage(ctx)}\nTry '{' '.join(path)} --help' for help.\n"
    except Exception:  # noqa: BLE001 - the error itself still gets printed
        return None


# Options whose value may be left out (``--ray`` alone: the cluster ``ray`` would connect to); typer has no
# optional-value options, so a bare one gets its default value here.
_OPTIONAL_VALUES = {"--ray": "auto"}


def _optional_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    for i, token in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if token in _OPTIONAL_VALUES and (nxt is None or nxt.startswith("-")):
            out.append(f"{token}={_OPTIONAL_VALUES[token]}")
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (also used as sys.exit)."""
    interrupts.install()   # SIGTERM/SIGHUP end a run like Ctrl-C does: teardown, partial report, exit 130
    debug = "--debug" in (argv if argv is not None else sys.argv[1:]) or os.environ.get("KVDIAG_DEBUG") == "1"
    try:
        args = list(argv) if argv is not None else sys.argv[1:]
        _register_all(args)
        rv = app(args=_optional_values(args), prog_name="kvdiag", standalone_mode=False)
    except KvdiagError as exc:
        if debug:
            raise
        if isinstance(exc, Interrupted) and exc.partial is not None:
            # Imported here: only a run that wrote a report gets here, and `banner` or `doctor` stay light.
            from kvdiag.cli.common import print_summary
            print_summary(exc.partial)   # type: ignore[arg-type]
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
    except Exception as exc:  # usage errors of the CLI library, else a bug: one line unless --debug
        if isinstance(exc, _cli_abort_types()):
            typer.echo("kvdiag: interrupted", err=True)
            return ExitCode.INTERRUPTED
        if isinstance(exc, _cli_usage_types()):
            _show_usage_error(exc, list(argv if argv is not None else sys.argv[1:]))
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
    interrupts.ignore_from_now()
    sys.exit(code)


if __name__ == "__main__":
    run()
