"""`kvdiag watch --url URL [--once]`: a passive sentinel beside running servers that names a stall."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from kvdiag.defaults import DEFAULT_PROBE_PERIOD_S, DEFAULT_TOOLS, WATCH_WINDOW_S
from kvdiag.runs.watch.session import WatchOptions, run_watch


def _human(line: str) -> None:
    typer.echo(f"kvdiag watch: {line}", err=True)


def watch_cmd(
    url: list[str] = typer.Option(..., "--url", help="A running server's base URL (repeat for several), e.g. "
                                  "http://127.0.0.1:8000.", show_default=False),
    pid: list[int] = typer.Option([], "--pid", help="Its API server or EngineCore pid, one per --url in the same "
                                  "order (default: the process listening on the URL's port, when local).",
                                  show_default=False),
    window: float = typer.Option(WATCH_WINDOW_S, "--window", help="Requests running or waiting and no "
                                 "progress for this many seconds is a stall."),
    once: bool = typer.Option(False, "--once", help="Exit at the first stall (10) instead of watching on."),
    out: Path = typer.Option(Path("reports/watch"), "--out", "-o", help="Folder for the report folders of "
                             "captured stalls (one stall-<engine>-<time>/ each)."),
    keep: int = typer.Option(20, "--keep", help="Keep at most this many report folders under --out (oldest "
                             "removed first)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", help="Serve kvdiag_watch_* Prometheus metrics "
                                            "on this port (0: any free port; default: none).", show_default=False),
    metrics_addr: str = typer.Option("127.0.0.1", "--metrics-addr", help="Address of the metrics endpoint "
                                     "(0.0.0.0 for a scraper in another pod)."),
    period: float = typer.Option(1.0, "--period", help="Seconds between two looks at each server."),
    cooldown: float = typer.Option(300.0, "--cooldown", help="After a capture, the same engine is not captured "
                                   "again for this many seconds (its stalls are still reported)."),
    duration: float | None = typer.Option(None, "--duration", help="Stop after this many seconds (default: run "
                                          "until SIGTERM/SIGHUP).", show_default=False),
    tools: str = typer.Option(",".join(DEFAULT_TOOLS), "--tools", help="Capture backends, comma-separated."),
    capture_timeout: float = typer.Option(10.0, "--capture-timeout", help="Bound on one capture, seconds."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="A stderr line for every look (default: one "
                                 "per engine a minute)."),
    probe: bool = typer.Option(False, "--probe", help="Also send one bounded one-token request (marked "
                               "kvdiag-probe-N) to a server that had no work and no progress for --probe-period: "
                               "no answer within --window is a stall (an engine that froze while idle)."),
    probe_period: float = typer.Option(DEFAULT_PROBE_PERIOD_S, "--probe-period", help="Seconds of idleness "
                                       "before a probe, and at least between two probes of one server."),
    ray: str | None = typer.Option(None, "--ray", metavar="ADDRESS", help="Capture a stall on every node of this "
                                   "Ray cluster (as `kvdiag capture --ray`; 'auto': the one `ray` connects to) "
                                   "instead of the local EngineCore; needs `pip install 'kvdiag[ray]'`.",
                                   show_default=False),
) -> int:
    """Follow running vLLM servers passively (no load of its own) and name a stall.

    Each period it reads /metrics, /health and, where the EngineCore is local, its state, wchan
    and CPU. A stall (requests in flight, no progress for --window, whatever /health says) is
    captured once, read-only, into a report folder under --out. Events are JSON lines on stdout,
    progress on stderr; the watched processes are never signalled. --probe sends an idle server a
    one-token request each --probe-period; --metrics-port also serves /ready (200/503).
    SIGTERM/SIGHUP stop it cleanly. Exit codes: 0 stopped cleanly, 10 a stall named (--once),
    5 a watched server never answered (nothing judged), 2 bad usage.
    """
    opts = WatchOptions(urls=list(url), pids=list(pid), window_s=window, period_s=period, once=once, out=out,
                        keep=keep, metrics_port=metrics_port, metrics_addr=metrics_addr, cooldown_s=cooldown,
                        duration_s=duration, tools=[t.strip() for t in tools.split(",") if t.strip()],
                        capture_timeout_s=capture_timeout, ray=ray, verbose=verbose, probe=probe,
                        probe_period_s=probe_period)
    opts.validate()
    outcome = run_watch(opts, sys.stdout, _human)
    for line in outcome.closing_lines():
        _human(line)
    return outcome.exit_code

def register(app: typer.Typer) -> None:
    app.command("watch")(watch_cmd)
