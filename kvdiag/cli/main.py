"""Entry point: runs the typer app and maps KvdiagError (and the CLI library's errors) to exit codes, once."""

from __future__ import annotations

import os
import sys

import typer

from kvdiag import interrupts
from kvdiag.cli.app import app, register_all
from kvdiag.cli.usage import cli_abort_types, cli_usage_types, optional_values, show_usage_error
from kvdiag.errors import ExitCode, Interrupted, KvdiagError


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (also used as sys.exit)."""
    interrupts.install()   # SIGTERM/SIGHUP end a run like Ctrl-C does: teardown, partial report, exit 130
    debug = "--debug" in (argv if argv is not None else sys.argv[1:]) or os.environ.get("KVDIAG_DEBUG") == "1"
    try:
        args = list(argv) if argv is not None else sys.argv[1:]
        register_all(args)
        rv = app(args=optional_values(args), prog_name="kvdiag", standalone_mode=False)
    except KvdiagError as exc:
        if debug:
            raise
        if isinstance(exc, Interrupted) and exc.partial is not None:
            # Imported here: only a run that wrote a report gets here, and `banner` or `doctor` stay light.
            from kvdiag.cli.common import print_outcome
            print_outcome(exc.partial)   # type: ignore[arg-type]
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
        if isinstance(exc, cli_abort_types()):
            typer.echo("kvdiag: interrupted", err=True)
            return ExitCode.INTERRUPTED
        if isinstance(exc, cli_usage_types()):
            show_usage_error(app, exc, list(argv if argv is not None else sys.argv[1:]))
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
