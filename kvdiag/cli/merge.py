"""`kvdiag merge DIR... [--out DIR]`: one report from captures taken separately on several hosts."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli.common import print_outcome
from kvdiag.errors import BundleError, UsageError
from kvdiag.model.fleet import FleetRecord
from kvdiag.runs.fleet.merge import NodePart, load_node_folder, merge_parts, missing_node, same_host_twice
from kvdiag.runs.outdir import prepare_out_dir
from kvdiag.runs.output import finish


def merge_cmd(
    folders: list[Path] = typer.Argument(..., metavar="DIR...", help="Capture folders (`kvdiag capture --out DIR` "
                                         "on each host or pod), each named after its host: the name is the node's."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: reports/merge-<timestamp>/)."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as JSON."),
) -> int:
    """Merge captures taken on several hosts (ssh, `kubectl exec`) into one bundle and one report.

    Each DIR is one host's `kvdiag capture --out DIR`; its folder name becomes the node's name.
    Processes are keyed by (node, pid); the report names each node's verdict, the worst first, and
    a folder without a readable bundle is named with why (the rest is still reported).
    Two captures of the same host (the same boot and network namespace) are refused; captures written more
    than the stall window apart (by their hosts' clocks) are named in the report.
    Exit codes: as capture; 2 when no folder holds a bundle, or two are of the same host.
    """
    if len(folders) < 1:
        raise UsageError("give at least one capture folder")
    parts: list[NodePart] = []
    for folder in folders:
        try:
            parts.append(load_node_folder(folder))
        except BundleError as exc:
            parts.append(missing_node(folder, None, exc.message))
    if not any(p.bundle is not None for p in parts):
        raise UsageError("no folder holds a readable bundle: " + "; ".join(p.record.reason or "" for p in parts))
    twice = same_host_twice(parts)
    if twice is not None:
        raise UsageError(twice)
    out_dir = prepare_out_dir(out, "merge")
    bundle_dir = out_dir / "bundle"
    merged = merge_parts(parts, command="merge " + " ".join(str(f) for f in folders),
                         fleet=FleetRecord(source="merge"), out_bundle_dir=bundle_dir)
    return print_outcome(finish(out_dir, merged), as_json)


def register(app: typer.Typer) -> None:
    app.command("merge")(merge_cmd)
