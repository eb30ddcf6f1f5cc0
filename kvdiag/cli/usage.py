"""What the CLI library says when the command line is wrong, as kvdiag shows it (exit 2)."""

from __future__ import annotations

import importlib

import click
import typer


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


def cli_usage_types() -> tuple[type[BaseException], ...]:
    """Bad-usage exceptions of click, and of the copies typer >= 0.26 vendors as ``typer._click`` (not
    subclasses of click's). pyproject pins both; both are listed so a drifted install still exits 2."""
    return _classes("click.exceptions:ClickException", "typer._click.exceptions:ClickException")


def cli_abort_types() -> tuple[type[BaseException], ...]:
    return _classes("click.exceptions:Abort", "typer._click.exceptions:Abort", "typer.exceptions:Abort")


def show_usage_error(app: typer.Typer, exc: BaseException, argv: list[str]) -> None:
    """click's own rendering (usage line, "Try ... --help", "Error: ..."); click leaves out the usage
    line for some errors (an option missing its value): then it is built from the command named."""
    usage = _usage_of(app, argv) if getattr(exc, "ctx", None) is None else None
    if usage:
        typer.echo(usage, err=True)
    if "Did you mean" in str(getattr(exc, "message", "")):   # typer's suggestion; click would add its own
        exc.possibilities = None   # type: ignore[attr-defined]
    if callable(show := getattr(exc, "show", None)):
        show()
    else:
        typer.echo(f"kvdiag: error: {exc}", err=True)


def _usage_of(app: typer.Typer, argv: list[str]) -> str | None:
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


def optional_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    for i, token in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if token in _OPTIONAL_VALUES and (nxt is None or nxt.startswith("-")):
            out.append(f"{token}={_OPTIONAL_VALUES[token]}")
        else:
            out.append(token)
    return out
