"""`kvdiag sim serve ...`: run the simulated engine by hand (same flags as `python -m kvdiag.sim serve`)."""

from __future__ import annotations

import typer

from kvdiag.sim.api_server import main

sim_app = typer.Typer(name="sim", help="The built-in simulated kvcached/vLLM engine.", no_args_is_help=True,
                      add_completion=False)


@sim_app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def serve_cmd(ctx: typer.Context) -> int:
    """Serve a simulated engine (API server + EngineCore). All flags: kvdiag sim serve --help."""
    return main(list(ctx.args))


def register(app: typer.Typer) -> None:
    """Add the `sim` command group to the kvdiag app."""
    app.add_typer(sim_app, name="sim")
