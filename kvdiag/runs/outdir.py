"""The output folder of a run: named, created and checked writable before anything is captured. Apart
from :mod:`kvdiag.runs.output` (which judges and renders), so a command can prepare it without loading
the analysis and the reports."""

from __future__ import annotations

import datetime as _dt
import secrets
import tempfile
from pathlib import Path

from kvdiag.errors import UsageError


def default_out_dir(command: str) -> Path:
    """reports/<command>-<timestamp>-<random>/ under the current directory (never reused)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("reports") / f"{command.replace(' ', '-')}-{stamp}-{secrets.token_hex(2)}"


def prepare_out_dir(out: Path | None, command: str) -> Path:
    """The output folder (``out``, else a new one under reports/), created and checked writable."""
    path = out if out is not None else default_out_dir(command)
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / "bundle").mkdir(exist_ok=True)
        # A fresh file of our own (never a same-named file someone keeps there), gone on close.
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvdiag-write-test-"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write output folder {path}: {exc.strerror or exc}",
                         hint="pass --out DIR pointing at a writable folder") from None
    return path


__all__ = ["default_out_dir", "prepare_out_dir"]
